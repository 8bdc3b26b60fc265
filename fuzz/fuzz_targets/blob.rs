//! The update blob: size, structure, decode, canonical form, validation against the layout.
#![no_main]
use libfuzzer_sys::fuzz_target;
use protocol::wire::UpdateRules;
mod common;

fuzz_target!(|data: &[u8]| {
    let run = common::run();
    let rules = UpdateRules::new(&run);
    let header = protocol::wire::UpdateHeader {
        run: run.run_id(),
        step: 0,
        sender: crypto::NodeId([0; 32]),
        blob: crypto::ContentId::of(data),
        blob_len: data.len() as u64,
        codec: run.optim.values,
        topk: run.optim.topk,
        chunk: run.optim.chunk,
        tokens: 0,
        base_version: 0,
        base_digest: crypto::Digest::default(),
    };
    let _ = rules.check_blob(&header, data);
});
