//! See `swarm_fuzz::cbor_precheck`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| swarm_fuzz::cbor_precheck(data));
