//! See `swarm_fuzz::blob`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| swarm_fuzz::blob(data));
