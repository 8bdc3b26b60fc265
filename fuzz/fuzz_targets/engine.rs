//! See `swarm_fuzz::engine`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| swarm_fuzz::engine(data));
