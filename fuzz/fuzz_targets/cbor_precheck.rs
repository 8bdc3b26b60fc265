//! The structural CBOR pre-check run before serde on every untrusted input.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = protocol::cbor::precheck(data);
});
