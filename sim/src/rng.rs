//! Seeded randomness: splitmix64. Small, fast, and identical on every machine, which is all a
//! deterministic simulator needs (nothing here is cryptographic).

#[derive(Clone, Debug)]
pub struct Rng(u64);

/// One splitmix64 finalizer round: a good 64-bit mix of `z`.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stream derived from several words (seed, node, step, purpose), so that independent uses
/// never share a stream and adding one use does not shift another's numbers.
pub fn derive(words: &[u64]) -> Rng {
    let mut h = 0x5157_4152_4d53_494d; // "SWARMSIM"
    for &w in words {
        h = mix(h ^ w);
    }
    Rng(h)
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            // Lemire's multiply-shift: unbiased enough for a simulator and branch-free.
            ((self.next_u64() as u128 * n as u128) >> 64) as u64
        }
    }
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }
    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}
