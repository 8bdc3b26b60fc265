//! See `swarm_fuzz::engine_signed`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    swarm_fuzz::engine_signed(data);
});
