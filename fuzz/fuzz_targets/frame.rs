//! Every frame kind: the decoder never panics, and what it accepts is canonical.
#![no_main]
use libfuzzer_sys::fuzz_target;
use protocol::wire::Message;
mod common;

fuzz_target!(|data: &[u8]| {
    let run = common::run();
    if let Ok(m) = Message::decode(data, &run.limits) {
        assert_eq!(m.encode(), data);
        match &m {
            Message::Equivocation(p) => {
                let _ = p.verify(&run.run_id());
            }
            Message::Announce { header, .. } | Message::Update { header, .. } => {
                let _ = header.verify();
            }
            _ => {}
        }
    }
});
