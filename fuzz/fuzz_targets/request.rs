//! See `swarm_fuzz::request`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| swarm_fuzz::request(data));
