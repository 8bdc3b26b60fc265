//! The engine fed hostile frames (as gossip and as fetch responses) and arbitrary timing.
#![no_main]
use libfuzzer_sys::fuzz_target;
use protocol::engine::{Engine, Event};
mod common;

fuzz_target!(|data: &[u8]| {
    let run = common::run();
    let mut e = Engine::new(
        run,
        crypto::Identity::from_seed([5; 32]),
        Some(crypto::Digest::default()),
        999_990,
        1,
    );
    let mut now = 1_000_000u64;
    // Input: a sequence of [ctrl, len, bytes…] records.
    let mut rest = data;
    while rest.len() >= 2 {
        let (ctrl, len) = (rest[0], rest[1] as usize);
        let body = &rest[2..(2 + len).min(rest.len())];
        rest = &rest[(2 + len).min(rest.len())..];
        now += (ctrl as u64 & 0x0f) * 150;
        let from = crypto::NodeId([ctrl; 32]);
        let ev = match ctrl >> 6 {
            0 => Event::Message {
                from,
                tag: Some(now),
                bytes: body.to_vec(),
            },
            1 => Event::Fetched {
                from,
                blob: crypto::ContentId::of(body),
                bytes: body.to_vec(),
            },
            2 => Event::Applied {
                step: ctrl as u64 & 7,
                digest: crypto::Digest::of(body),
            },
            _ => Event::Timer,
        };
        let _ = e.handle(ev, now);
    }
});
