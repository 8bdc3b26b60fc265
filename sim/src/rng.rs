//! Seeded randomness for the simulator: the protocol's splitmix64 stream
//! (`protocol::rng`), and streams derived from several words.

pub use protocol::rng::{mix, Rng};

/// A stream derived from several words (seed, node, step, purpose), so that independent uses
/// never share a stream and adding one use does not shift another's numbers.
pub fn derive(words: &[u64]) -> Rng {
    let mut h = 0x5157_4152_4d53_494d; // "SWARMSIM"
    for &w in words {
        h = mix(h ^ w);
    }
    Rng::from_state(h)
}
