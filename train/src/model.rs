//! A Llama-2 style decoder on tch: token embedding, RMSNorm, RoPE (θ from the config),
//! causal multi-head attention with grouped-query support, SwiGLU MLP, untied output head,
//! no biases.
//!
//! Parameters are f32 "master" weights. On CUDA the matmuls and attention run in bf16 (an
//! explicit form of autocast: tch's `autocast` only switches libtorch's default, which is
//! fp16, and offers no way to choose bf16); norms, softmax statistics and the loss stay f32.

use protocol::config::ModelConfig;
use tch::{nn, Device, Kind, Tensor};

pub struct Llama {
    pub cfg: ModelConfig,
    pub vs: nn::VarStore,
    /// Parameters in the canonical order of `ModelConfig::tensor_shapes` (wire order).
    pub params: Vec<Tensor>,
    pub names: Vec<String>,
    compute: Kind,
    rope_cos: Tensor,
    rope_sin: Tensor,
}

struct Layer<'a> {
    attn_norm: &'a Tensor,
    wq: &'a Tensor,
    wk: &'a Tensor,
    wv: &'a Tensor,
    wo: &'a Tensor,
    ffn_norm: &'a Tensor,
    w1: &'a Tensor,
    w3: &'a Tensor,
    w2: &'a Tensor,
}

impl Llama {
    /// A freshly initialized model; `seed` makes the initialization reproducible (every node of
    /// a run starts from the same weights).
    pub fn new(cfg: &ModelConfig, device: Device, seed: u64) -> Llama {
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let shapes = cfg.tensor_shapes();
        // Initialize on the CPU from a seeded generator, then copy, so that CPU and CUDA nodes
        // start bit-identical. libtorch's generator is process-global: hold a lock from the
        // seed to the last draw, or two models built at once (the simulator, parallel tests)
        // would interleave their draws and start from different weights.
        static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _init = INIT.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed as i64);
        let std = 0.02;
        let out_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let mut params = Vec::with_capacity(shapes.len());
        let mut names = Vec::with_capacity(shapes.len());
        for (name, shape) in &shapes {
            let dims: Vec<i64> = shape.iter().map(|&x| x as i64).collect();
            let init = if name.ends_with("norm.weight") {
                Tensor::ones(&dims[..], (Kind::Float, Device::Cpu))
            } else {
                let s = if name.ends_with("wo.weight") || name.ends_with("w2.weight") {
                    out_std
                } else {
                    std
                };
                Tensor::randn(&dims[..], (Kind::Float, Device::Cpu)) * s
            };
            let mut path = root.clone();
            let parts: Vec<&str> = name.split('.').collect();
            for p in &parts[..parts.len() - 1] {
                path = path / *p;
            }
            let v = path.var_copy(parts[parts.len() - 1], &init.to_device(device));
            params.push(v);
            names.push(name.clone());
        }
        let compute = if device.is_cuda() {
            Kind::BFloat16
        } else {
            Kind::Float
        };
        let (rope_cos, rope_sin) = rope_tables(cfg, device);
        Llama {
            cfg: cfg.clone(),
            vs,
            params,
            names,
            compute,
            rope_cos,
            rope_sin,
        }
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    fn layer(&self, l: usize) -> Layer<'_> {
        let b = 1 + 9 * l;
        let p = &self.params;
        Layer {
            attn_norm: &p[b],
            wq: &p[b + 1],
            wk: &p[b + 2],
            wv: &p[b + 3],
            wo: &p[b + 4],
            ffn_norm: &p[b + 5],
            w1: &p[b + 6],
            w3: &p[b + 7],
            w2: &p[b + 8],
        }
    }

    fn linear(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.to_kind(self.compute)
            .matmul(&w.to_kind(self.compute).tr())
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        let xf = x.to_kind(Kind::Float);
        let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        xf * (var + self.cfg.norm_eps).rsqrt() * w
    }

    /// Rotary embedding on `[B, H, T, hd]` (rotate-half form).
    fn rope(&self, x: &Tensor, t: i64) -> Tensor {
        let hd = x.size()[3];
        let cos = self.rope_cos.narrow(0, 0, t).to_kind(x.kind());
        let sin = self.rope_sin.narrow(0, 0, t).to_kind(x.kind());
        let x1 = x.narrow(3, 0, hd / 2);
        let x2 = x.narrow(3, hd / 2, hd / 2);
        Tensor::cat(&[&x1 * &cos - &x2 * &sin, &x1 * &sin + &x2 * &cos], 3)
    }

    /// Logits `[B, T, V]` (f32) for tokens `[B, T]`.
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        let (b, t) = tokens.size2().expect("tokens are [B, T]");
        let c = &self.cfg;
        let (h, kvh, hd) = (c.heads as i64, c.kv_heads as i64, c.head_dim() as i64);
        let mut x = Tensor::embedding(&self.params[0], tokens, -1, false, false);
        for l in 0..c.layers as usize {
            let ly = self.layer(l);
            let hn = self.rms_norm(&x, ly.attn_norm);
            let q = self.linear(&hn, ly.wq).view([b, t, h, hd]).transpose(1, 2);
            let k = self
                .linear(&hn, ly.wk)
                .view([b, t, kvh, hd])
                .transpose(1, 2);
            let v = self
                .linear(&hn, ly.wv)
                .view([b, t, kvh, hd])
                .transpose(1, 2);
            let (q, k) = (self.rope(&q, t), self.rope(&k, t));
            // Grouped-query attention: repeat each KV head over its group of query heads.
            let (k, v) = if kvh != h {
                let rep = h / kvh;
                (
                    k.repeat_interleave_self_int(rep, 1, None),
                    v.repeat_interleave_self_int(rep, 1, None),
                )
            } else {
                (k, v)
            };
            let a = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                None::<Tensor>,
                0.0,
                true,
                None,
                false,
            );
            let a = a.transpose(1, 2).contiguous().view([b, t, h * hd]);
            x = x + self.linear(&a, ly.wo).to_kind(Kind::Float);
            let hn = self.rms_norm(&x, ly.ffn_norm);
            let g = self.linear(&hn, ly.w1).silu() * self.linear(&hn, ly.w3);
            x = x + self.linear(&g, ly.w2).to_kind(Kind::Float);
        }
        let x = self.rms_norm(&x, &self.params[self.params.len() - 2]);
        self.linear(&x, &self.params[self.params.len() - 1])
            .to_kind(Kind::Float)
    }

    /// Mean next-token cross-entropy (nats) of `targets` given `inputs`.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(inputs);
        let v = logits.size()[2];
        logits
            .reshape([-1, v])
            .cross_entropy_for_logits(&targets.reshape([-1]))
    }

    pub fn zero_grad(&self) {
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// Copies of the current gradients (zeros where a parameter got none).
    pub fn grads(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() {
                    g.detach().copy()
                } else {
                    p.zeros_like()
                }
            })
            .collect()
    }

    pub fn numel(&self) -> i64 {
        self.params.iter().map(|p| p.numel() as i64).sum()
    }

    /// Save as safetensors, atomically (a temp file renamed into place), so a crash never
    /// leaves a torn checkpoint.
    pub fn save(&self, path: &std::path::Path) -> Result<(), crate::TrainError> {
        let tmp = path.with_extension("safetensors.tmp");
        let named: Vec<(&str, Tensor)> = self
            .names
            .iter()
            .zip(&self.params)
            .map(|(n, p)| (n.as_str(), p.to_device(Device::Cpu)))
            .collect();
        Tensor::write_safetensors(&named, &tmp)?;
        let f = std::fs::File::open(&tmp)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Load parameters from a safetensors checkpoint written by [`Llama::save`].
    pub fn load(&mut self, path: &std::path::Path) -> Result<(), crate::TrainError> {
        let tensors = Tensor::read_safetensors(path)?;
        let map: std::collections::BTreeMap<String, Tensor> = tensors.into_iter().collect();
        tch::no_grad(|| -> Result<(), crate::TrainError> {
            for (n, p) in self.names.iter().zip(self.params.iter_mut()) {
                let t = map
                    .get(n)
                    .ok_or_else(|| crate::CheckpointError::MissingTensor(n.clone()))?;
                if t.size() != p.size() {
                    return Err(crate::CheckpointError::Shape {
                        tensor: n.clone(),
                        have: t.size(),
                        want: p.size(),
                    }
                    .into());
                }
                p.copy_(&t.to_kind(Kind::Float));
            }
            Ok(())
        })
    }

    /// Set the parameters from named tensors (any float kind, any device): every tensor of
    /// the model must be there with its shape (`hf::check_shapes`).
    pub fn set_params(&mut self, tensors: &[(String, Tensor)]) -> Result<(), crate::TrainError> {
        crate::hf::check_shapes(&self.cfg, tensors)?;
        let map: std::collections::HashMap<&str, &Tensor> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        tch::no_grad(|| {
            for (n, p) in self.names.iter().zip(self.params.iter_mut()) {
                p.copy_(&map[n.as_str()].to_kind(Kind::Float).to_device(p.device()));
            }
        });
        Ok(())
    }

    /// The parameter digest of the protocol (`protocol::checkpoint::params_digest`): equal
    /// digests mean bit-identical models, and it is what summaries and checkpoints carry.
    pub fn digest(&self) -> [u8; 32] {
        named_digest(&self.names, &self.params)
    }
}

/// A tensor's values as f32 little-endian bytes, row-major: the form parameters take in
/// digests, checkpoints and served snapshots.
pub fn f32_le_bytes(p: &Tensor) -> Vec<u8> {
    let c = p
        .detach()
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous();
    let len = c.numel();
    let mut buf = vec![0f32; len];
    c.view([-1]).copy_data(&mut buf, len);
    buf.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `protocol::checkpoint::params_digest` of named f32 tensors.
pub fn named_digest(names: &[String], params: &[Tensor]) -> [u8; 32] {
    let shapes: Vec<Vec<u32>> = params
        .iter()
        .map(|p| p.size().iter().map(|&d| d as u32).collect())
        .collect();
    let bytes: Vec<Vec<u8>> = params.iter().map(f32_le_bytes).collect();
    protocol::checkpoint::f32_params_digest(
        names
            .iter()
            .zip(&shapes)
            .zip(&bytes)
            .map(|((n, s), b)| (n.as_str(), s.as_slice(), b.as_slice())),
    )
    .0
}

/// Digest of unnamed tensors (names `0`, `1`, …), for tests and tools.
pub fn param_digest(params: &[Tensor]) -> [u8; 32] {
    let names: Vec<String> = (0..params.len()).map(|i| i.to_string()).collect();
    named_digest(&names, params)
}

fn rope_tables(cfg: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let hd = cfg.head_dim() as i64;
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| (1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
        .collect();
    let inv = Tensor::from_slice(&inv);
    let pos = Tensor::arange(cfg.seq_len as i64, (Kind::Float, Device::Cpu));
    let ang = pos.unsqueeze(1) * inv.unsqueeze(0); // [T, half]
    (ang.cos().to_device(device), ang.sin().to_device(device))
}
