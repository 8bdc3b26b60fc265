//! See `swarm_fuzz::download`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    swarm_fuzz::download(data);
});
