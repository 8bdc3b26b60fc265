//! Seeded randomness: splitmix64. Small, fast and identical on every machine, which is all the
//! engine (candidate choice, sampling), the simulator and the tests need. Nothing here is
//! cryptographic: anything an attacker must not predict or forge uses `crypto`.

/// splitmix64's increment (2^64 / φ).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// One splitmix64 round on `z`: a good 64-bit mix (also a cheap keyed hash of a word).
pub fn mix(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A splitmix64 stream.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The stream whose state is `state` as given (its first number is `mix(state)`).
    pub fn from_state(state: u64) -> Rng {
        Rng(state)
    }
    /// The stream for `seed`, its state mixed first.
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        let z = self.0;
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(z)
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
            // Lemire's multiply-shift: unbiased enough here and branch-free.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_splitmix64() {
        // The reference splitmix64 of state 0: its first outputs.
        let mut r = Rng::from_state(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }
}
