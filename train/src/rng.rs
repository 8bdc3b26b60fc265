//! A small, stable PRNG (xoshiro256**, seeded through splitmix64). Its output is fixed by this
//! file, not by a dependency's version, because batches must be recomputable by anyone.

#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// Seed from a domain string and arbitrary parts, through blake3.
    pub fn derive(domain: &str, parts: &[&[u8]]) -> Rng {
        let mut h = blake3::Hasher::new_derive_key(domain);
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        let d = h.finalize();
        Rng::new(u64::from_le_bytes(
            d.as_bytes()[..8]
                .try_into()
                .expect("a blake3 digest has 32 bytes"),
        ))
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n) (n > 0), without modulo bias worth caring about at these sizes.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// A standard-normal tensor of `shape` drawn from [`Rng`] seeded by `seed` (Box–Muller), on
/// the CPU. Tests and tools use it instead of `Tensor::randn`: libtorch's generator is
/// process-global, so tests running in parallel would interleave their draws with each other
/// and with `Llama::new`, and get different values from run to run.
pub fn randn(shape: &[i64], seed: u64) -> tch::Tensor {
    let n: i64 = shape.iter().product();
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(n as usize);
    while (v.len() as i64) < n {
        // 1 − u keeps the logarithm finite.
        let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        v.push((r * a.cos()) as f32);
        v.push((r * a.sin()) as f32);
    }
    v.truncate(n as usize);
    tch::Tensor::from_slice(&v).view(shape)
}
