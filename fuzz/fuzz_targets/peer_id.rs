//! See `swarm_fuzz::peer_id`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| swarm_fuzz::peer_id(data));
