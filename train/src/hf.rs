//! Hugging Face `transformers` checkpoints: export a swarm model as a directory that
//! `AutoModelForCausalLM.from_pretrained` loads as a `LlamaForCausalLM`, and import one back.
//!
//! The two models compute the same function, so the conversion is a renaming:
//! - swarm's attention applies RoPE in the *rotate-half* form (the first and second half of each
//!   head's dimensions are the pairs, `Llama::rope`), which is what HF's `LlamaAttention` does.
//!   Meta's original checkpoints pair *interleaved* dimensions, which is why HF's own
//!   conversion script permutes the rows of q and k; a swarm checkpoint was trained in HF's
//!   layout already and must not be permuted. The suite proves this by numbers
//!   (`node/tests/hf.rs` compares HF's logits with swarm's on a fixed batch), not by names.
//! - RMSNorm (`x · rsqrt(mean(x²) + ε) · w`), SwiGLU (`w2(silu(w1 x) · w3 x)`), no biases, an
//!   untied head and the causal softmax scaled by 1/√head_dim are the same in both.
//!
//! Files are read and written with the `safetensors` crate directly (not through libtorch),
//! so the model's configuration can travel in the file's metadata (`swarm.model`).

use crate::{CheckpointError, HfConfigError, TrainError};
use protocol::config::ModelConfig;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tch::{Kind, Tensor};

/// Metadata key holding the model configuration (JSON) in files `swarm import` writes.
pub const MODEL_META: &str = "swarm.model";

/// HF's name of a swarm tensor (`layers.0.attention.wq.weight` →
/// `model.layers.0.self_attn.q_proj.weight`), `None` for a name swarm never writes.
pub fn hf_name(ours: &str) -> Option<String> {
    match ours {
        "tok_embeddings.weight" => return Some("model.embed_tokens.weight".into()),
        "norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = ours.strip_prefix("layers.")?;
    let (l, part) = rest.split_once('.')?;
    l.parse::<u32>().ok()?;
    let hf = match part {
        "attention_norm.weight" => "input_layernorm.weight",
        "attention.wq.weight" => "self_attn.q_proj.weight",
        "attention.wk.weight" => "self_attn.k_proj.weight",
        "attention.wv.weight" => "self_attn.v_proj.weight",
        "attention.wo.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "feed_forward.w1.weight" => "mlp.gate_proj.weight",
        "feed_forward.w3.weight" => "mlp.up_proj.weight",
        "feed_forward.w2.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{l}.{hf}"))
}

/// The HF `config.json` of a model (Llama architecture, f32 or bf16 weights).
pub fn config_json(cfg: &ModelConfig, dtype: &str) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        // transformers 5 reads `rope_parameters`; older releases read `rope_theta`.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": false,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "dtype": dtype,
        "torch_dtype": dtype,
        "swarm_model": cfg.name,
    })
}

/// The model configuration of an HF Llama `config.json`; `seq_len` overrides
/// `max_position_embeddings` (Llama 3's 131,072 is a poor training length).
pub fn config_from_json(
    v: &serde_json::Value,
    name: &str,
    seq_len: Option<u32>,
) -> Result<ModelConfig, TrainError> {
    let bad = |e: HfConfigError| TrainError::from(CheckpointError::HfConfig(e));
    let int = |k: &'static str| -> Result<u32, TrainError> {
        v.get(k)
            .and_then(|x| x.as_u64())
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| bad(HfConfigError::Field(k)))
    };
    let mt = v.get("model_type").and_then(|x| x.as_str()).unwrap_or("");
    if mt != "llama" {
        return Err(bad(HfConfigError::NotLlama(mt.to_string())));
    }
    for flag in ["attention_bias", "mlp_bias"] {
        if v.get(flag).and_then(|x| x.as_bool()) == Some(true) {
            return Err(bad(HfConfigError::Bias(flag)));
        }
    }
    if let Some(act) = v.get("hidden_act").and_then(|x| x.as_str()) {
        if act != "silu" {
            return Err(bad(HfConfigError::Activation(act.to_string())));
        }
    }
    // RoPE: θ from either spelling; only the plain (unscaled) form is swarm's.
    let rope = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
    if let Some(r) = rope.filter(|r| !r.is_null()) {
        let ty = r
            .get("rope_type")
            .or_else(|| r.get("type"))
            .and_then(|x| x.as_str())
            .unwrap_or("default");
        if ty != "default" {
            return Err(bad(HfConfigError::RopeScaling(ty.to_string())));
        }
    }
    let theta = v
        .get("rope_parameters")
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| v.get("rope_theta"))
        .and_then(|x| x.as_f64())
        .unwrap_or(10000.0);
    let heads = int("num_attention_heads")?;
    let dim = int("hidden_size")?;
    if heads == 0 || dim % heads != 0 {
        return Err(bad(HfConfigError::HeadSplit { dim, heads }));
    }
    if let Some(hd) = v.get("head_dim").and_then(|x| x.as_u64()) {
        if hd != (dim / heads) as u64 {
            return Err(bad(HfConfigError::HeadDim {
                head_dim: hd,
                derived: dim / heads,
            }));
        }
    }
    let kv_heads = v
        .get("num_key_value_heads")
        .and_then(|x| x.as_u64())
        .map(|x| x as u32)
        .unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(bad(HfConfigError::KvHeads { heads, kv_heads }));
    }
    Ok(ModelConfig {
        name: name.to_string(),
        vocab: int("vocab_size")?,
        dim,
        layers: int("num_hidden_layers")?,
        heads,
        kv_heads,
        ffn: int("intermediate_size")?,
        seq_len: match seq_len {
            Some(s) => s,
            None => int("max_position_embeddings")?,
        },
        rope_theta: theta,
        norm_eps: v
            .get("rms_norm_eps")
            .and_then(|x| x.as_f64())
            .unwrap_or(1e-5),
    })
}

/// Tensor names with their shapes, from a tensor list.
pub type Shapes = Vec<(String, Vec<i64>)>;

/// Names with shapes of named tensors.
pub fn shapes_of(tensors: &[(String, Tensor)]) -> Shapes {
    tensors.iter().map(|(n, t)| (n.clone(), t.size())).collect()
}

/// A safetensors file's tensor names, shapes and metadata, from its header alone (the values
/// are mapped, not read): enough to tell which model a checkpoint holds before loading it.
pub fn read_header(path: &Path) -> Result<(Shapes, HashMap<String, String>), TrainError> {
    let f = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    // Safety: as in `read_f32`.
    let m = unsafe { memmap2::Mmap::map(&f) }?;
    let (_, meta) = SafeTensors::read_metadata(&m).map_err(CheckpointError::safetensors(path))?;
    let mut shapes: Shapes = meta
        .tensors()
        .into_iter()
        .map(|(n, info)| (n, info.shape.iter().map(|&x| x as i64).collect()))
        .collect();
    shapes.sort();
    Ok((shapes, meta.metadata().clone().unwrap_or_default()))
}

/// Tensors of a safetensors file as f32 CPU tensors (f32, bf16 and f16 files), and the file's
/// metadata.
pub fn read_f32(
    path: &Path,
) -> Result<(Vec<(String, Tensor)>, HashMap<String, String>), TrainError> {
    let f = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    // Safety: a read-only mapping of a file we only read; a concurrent writer could change
    // values, never the bounds safetensors checks.
    let m = unsafe { memmap2::Mmap::map(&f) }?;
    let st = SafeTensors::deserialize(&m).map_err(CheckpointError::safetensors(path))?;
    let (_, meta) = SafeTensors::read_metadata(&m).map_err(CheckpointError::safetensors(path))?;
    let mut out = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    for name in names {
        let t = st
            .tensor(&name)
            .map_err(CheckpointError::safetensors(path))?;
        let shape: Vec<i64> = t.shape().iter().map(|&x| x as i64).collect();
        let vals = to_f32(t.dtype(), t.data()).map_err(CheckpointError::dtype(path, &name))?;
        out.push((name, Tensor::from_slice(&vals).view(&shape[..])));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Little-endian f32, bf16 or f16 bytes as f32 values; any other type is given back.
fn to_f32(dtype: Dtype, d: &[u8]) -> Result<Vec<f32>, Dtype> {
    Ok(match dtype {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(other),
    })
}

/// Stream a safetensors file's tensors, sorted by name, as f32 CPU tensors: `f(i, name,
/// tensor)` sees one at a time. Each tensor's bytes are read from the file on their own (not
/// mapped), so the process holds one tensor and its f32 copy at a time, never the file: a
/// model several times the machine's free memory can be encoded.
pub fn for_each_f32(
    path: &Path,
    mut f: impl FnMut(usize, &str, Tensor) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    // The header through a mapping (safetensors checks it against the file's length); only
    // its pages are touched, and the mapping is gone before any value is read.
    let (n, mut infos) = {
        // Safety: as in `read_f32`.
        let m = unsafe { memmap2::Mmap::map(&file) }?;
        let (n, meta) =
            SafeTensors::read_metadata(&m).map_err(CheckpointError::safetensors(path))?;
        let infos: Vec<(String, safetensors::tensor::TensorInfo)> = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        (n as u64, infos)
    };
    let file_len = file.metadata()?.len();
    infos.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (name, info)) in infos.into_iter().enumerate() {
        let (lo, hi) = info.data_offsets;
        let at = 8 + n + lo as u64;
        if hi < lo || at + (hi - lo) as u64 > file_len {
            return Err(CheckpointError::PastEnd {
                path: path.into(),
                tensor: name,
            }
            .into());
        }
        let mut bytes = vec![0u8; hi - lo];
        file.read_exact_at(&mut bytes, at)?;
        let vals = to_f32(info.dtype, &bytes).map_err(CheckpointError::dtype(path, &name))?;
        drop(bytes);
        let shape: Vec<i64> = info.shape.iter().map(|&x| x as i64).collect();
        if vals.len() as i64 != shape.iter().product::<i64>() {
            return Err(CheckpointError::ValueCount {
                path: path.into(),
                tensor: name,
                values: vals.len(),
                shape,
            }
            .into());
        }
        f(i, &name, Tensor::from_slice(&vals).view(&shape[..]))?;
    }
    Ok(())
}

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Write named tensors as a safetensors file (f32, or bf16 when `bf16`), atomically: a temp
/// file renamed into place, so a crash never leaves a torn file.
pub fn write(
    path: &Path,
    tensors: &[(String, Tensor)],
    bf16: bool,
    meta: HashMap<String, String>,
) -> Result<(), TrainError> {
    let raws: Vec<(String, Raw)> = tensors
        .iter()
        .map(|(n, t)| {
            let bytes = crate::model::f32_le_bytes(t);
            let (dtype, data) = if bf16 {
                let d: Vec<u8> = bytes
                    .chunks_exact(4)
                    .flat_map(|c| {
                        half::bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .to_le_bytes()
                    })
                    .collect();
                (Dtype::BF16, d)
            } else {
                (Dtype::F32, bytes)
            };
            let shape = t.size().iter().map(|&x| x as usize).collect();
            (n.clone(), Raw { dtype, shape, data })
        })
        .collect();
    let tmp = path.with_extension("tmp");
    safetensors::serialize_to_file(raws.iter().map(|(n, r)| (n.as_str(), r)), Some(meta), &tmp)
        .map_err(CheckpointError::safetensors(&tmp))?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The model configuration of a swarm checkpoint: the `swarm.model` metadata of a file
/// `swarm import` wrote, else the named configuration (`tiny`, `small`, `1.2b`) whose tensor
/// shapes match the file's. `None` when neither says (then the run file must).
pub fn infer_config(
    shapes: &[(String, Vec<i64>)],
    meta: &HashMap<String, String>,
) -> Result<ModelConfig, TrainError> {
    if let Some(j) = meta.get(MODEL_META) {
        return serde_json::from_str(j)
            .map_err(|source| CheckpointError::ModelMeta { source }.into());
    }
    let emb = shapes
        .iter()
        .find(|(n, _)| n == "tok_embeddings.weight")
        .map(|(_, s)| s.clone())
        .ok_or(CheckpointError::NotSwarm)?;
    let vocab = emb[0] as u32;
    for name in ["tiny", "small", "1.2b"] {
        let Some(mut c) = ModelConfig::named(name, vocab) else {
            continue;
        };
        // `tiny` and `small` take the data's vocabulary; `1.2b` has a fixed one.
        c.vocab = vocab;
        if check_shape_list(&c, shapes).is_ok() {
            return Ok(c);
        }
    }
    let layers = shapes
        .iter()
        .filter(|(n, _)| n.ends_with(".attention_norm.weight"))
        .count();
    Err(CheckpointError::UnknownModel {
        vocab,
        dim: emb[1],
        layers,
    }
    .into())
}

/// Check that `tensors` are exactly the tensors of `cfg`, with its shapes.
pub fn check_shapes(cfg: &ModelConfig, tensors: &[(String, Tensor)]) -> Result<(), TrainError> {
    check_shape_list(cfg, &shapes_of(tensors))
}

/// Check that `shapes` name exactly the tensors of `cfg`, with its shapes.
pub fn check_shape_list(
    cfg: &ModelConfig,
    shapes: &[(String, Vec<i64>)],
) -> Result<(), TrainError> {
    let have: BTreeMap<&str, &Vec<i64>> = shapes.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let want = cfg.tensor_shapes();
    for (n, s) in &want {
        let s: Vec<i64> = s.iter().map(|&x| x as i64).collect();
        match have.get(n.as_str()) {
            None => return Err(CheckpointError::MissingTensor(n.clone()).into()),
            Some(h) if **h != s => {
                return Err(CheckpointError::Shape {
                    tensor: n.clone(),
                    have: h.to_vec(),
                    want: s,
                }
                .into())
            }
            _ => {}
        }
    }
    if have.len() != want.len() {
        return Err(CheckpointError::TensorCount {
            have: have.len(),
            want: want.len(),
        }
        .into());
    }
    Ok(())
}

/// What `export` wrote.
#[derive(Debug)]
pub struct Exported {
    pub files: Vec<String>,
    pub params: i64,
}

/// Write `dir` as an HF model directory: `model.safetensors` (HF names), `config.json`,
/// `generation_config.json`, and `tokenizer.json` when the run has one.
pub fn export(
    cfg: &ModelConfig,
    tensors: &[(String, Tensor)],
    dir: &Path,
    bf16: bool,
    tokenizer: Option<&Path>,
) -> Result<Exported, TrainError> {
    check_shapes(cfg, tensors)?;
    std::fs::create_dir_all(dir)?;
    let mut hf = Vec::with_capacity(tensors.len());
    let mut params = 0;
    for (n, t) in tensors {
        let h = hf_name(n).ok_or_else(|| CheckpointError::NoHfName(n.clone()))?;
        params += t.numel() as i64;
        hf.push((h, t.shallow_clone()));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write(&dir.join("model.safetensors"), &hf, bf16, meta)?;
    let dtype = if bf16 { "bfloat16" } else { "float32" };
    let mut files = vec!["model.safetensors".to_string()];
    let json =
        |name: &str, v: serde_json::Value, files: &mut Vec<String>| -> Result<(), TrainError> {
            let s = serde_json::to_string_pretty(&v).expect("plain JSON");
            std::fs::write(dir.join(name), s + "\n")?;
            files.push(name.to_string());
            Ok(())
        };
    json("config.json", config_json(cfg, dtype), &mut files)?;
    // Sampling defaults only; swarm's vocabularies (bytes, the synthetic chain) have no
    // special tokens, so none are named.
    json(
        "generation_config.json",
        serde_json::json!({"do_sample": true, "temperature": 1.0, "max_length": cfg.seq_len}),
        &mut files,
    )?;
    if let Some(t) = tokenizer {
        std::fs::copy(t, dir.join("tokenizer.json")).map_err(CheckpointError::io(t))?;
        files.push("tokenizer.json".into());
    }
    Ok(Exported { files, params })
}

/// Read an HF Llama directory (`config.json` and `model.safetensors`, or the shards a
/// `model.safetensors.index.json` names) as a swarm model: its configuration and tensors in
/// swarm's names and canonical order. A tied head (`tie_word_embeddings`) becomes an untied
/// copy of the embedding.
pub fn import(
    dir: &Path,
    name: &str,
    seq_len: Option<u32>,
) -> Result<(ModelConfig, Vec<(String, Tensor)>), TrainError> {
    let cfg_path = dir.join("config.json");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).map_err(CheckpointError::io(&cfg_path))?)
            .map_err(CheckpointError::json(&cfg_path))?;
    let cfg = config_from_json(&v, name, seq_len)?;
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if index.exists() {
        let ix: serde_json::Value = serde_json::from_slice(&std::fs::read(&index)?)
            .map_err(CheckpointError::json(&index))?;
        let map = ix
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CheckpointError::NoWeightMap {
                path: index.clone(),
            })?;
        let mut f: Vec<String> = map
            .values()
            .filter_map(|x| x.as_str().map(String::from))
            .collect();
        f.sort();
        f.dedup();
        f.into_iter().map(|s| dir.join(s)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut by_hf: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        for (n, t) in read_f32(f)?.0 {
            by_hf.insert(n, t);
        }
    }
    let tied = v.get("tie_word_embeddings").and_then(|x| x.as_bool()) == Some(true);
    let mut out = Vec::new();
    let missing = |tensor: &str| CheckpointError::NoHfTensor {
        dir: dir.into(),
        tensor: tensor.into(),
    };
    for (ours, _) in cfg.tensor_shapes() {
        let h = hf_name(&ours).expect("every swarm tensor has an HF name");
        let t = match by_hf.get(&h) {
            Some(t) => t.shallow_clone(),
            None if tied && ours == "output.weight" => by_hf
                .get("model.embed_tokens.weight")
                .map(|t| t.copy())
                .ok_or_else(|| missing("model.embed_tokens.weight"))?,
            None => return Err(missing(&h).into()),
        };
        out.push((ours, t.to_kind(Kind::Float)));
    }
    check_shapes(&cfg, &out)?;
    Ok((cfg, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tensor_has_a_distinct_hf_name() {
        let cfg = ModelConfig::named("small", 256).unwrap();
        let names: Vec<String> = cfg
            .tensor_shapes()
            .iter()
            .map(|(n, _)| hf_name(n).unwrap())
            .collect();
        let mut d = names.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), names.len());
        assert_eq!(
            hf_name("layers.3.feed_forward.w2.weight").unwrap(),
            "model.layers.3.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("layers.x.attention.wq.weight"), None);
        assert_eq!(hf_name("rope.freqs"), None);
    }

    #[test]
    fn config_round_trips_through_config_json() {
        for name in ["tiny", "small", "1.2b"] {
            let c = ModelConfig::named(name, 256).unwrap();
            let back = config_from_json(&config_json(&c, "float32"), name, None).unwrap();
            assert_eq!(back, c);
        }
    }

    #[test]
    fn scaled_rope_and_biases_are_refused() {
        let c = ModelConfig::named("tiny", 256).unwrap();
        let mut v = config_json(&c, "float32");
        v["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5});
        assert!(config_from_json(&v, "x", None).is_err());
        let mut v = config_json(&c, "float32");
        v["attention_bias"] = serde_json::json!(true);
        assert!(config_from_json(&v, "x", None).is_err());
        let mut v = config_json(&c, "float32");
        v["model_type"] = serde_json::json!("mistral");
        assert!(config_from_json(&v, "x", None).is_err());
    }

    /// A `tiny` model of `seed` and its named tensors.
    fn tiny_named(seed: u64) -> (ModelConfig, crate::model::Llama, Vec<(String, Tensor)>) {
        let cfg = ModelConfig::named("tiny", 256).unwrap();
        let m = crate::model::Llama::new(&cfg, tch::Device::Cpu, seed);
        let tensors = m
            .names
            .iter()
            .cloned()
            .zip(m.params.iter().map(|p| p.detach()))
            .collect();
        (cfg, m, tensors)
    }

    #[test]
    fn export_then_import_is_bit_identical() {
        let (cfg, m, tensors) = tiny_named(7);
        let dir = std::env::temp_dir().join(format!("swarm-hf-{}", std::process::id()));
        let e = export(&cfg, &tensors, &dir, false, None).unwrap();
        assert_eq!(e.params, m.numel());
        let (c2, t2) = import(&dir, "tiny", None).unwrap();
        assert_eq!(c2, cfg);
        let names: Vec<String> = t2.iter().map(|(n, _)| n.clone()).collect();
        let params: Vec<Tensor> = t2.into_iter().map(|(_, t)| t).collect();
        assert_eq!(crate::model::named_digest(&names, &params), m.digest());
        // bf16 on disk: half the bytes, each value within bf16's rounding of the original.
        export(&cfg, &tensors, &dir, true, None).unwrap();
        let (_, t3) = import(&dir, "tiny", None).unwrap();
        for ((_, a), (_, b)) in tensors.iter().zip(&t3) {
            let rel = (a - b).abs().max().double_value(&[]) / a.abs().max().double_value(&[]);
            assert!(rel < 1.0 / 128.0, "{rel}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    #[test]
    fn streaming_a_file_gives_the_tensors_read_at_once() {
        let (_, _, tensors) = tiny_named(3);
        let path =
            std::env::temp_dir().join(format!("swarm-stream-{}.safetensors", std::process::id()));
        for bf16 in [false, true] {
            write(&path, &tensors, bf16, HashMap::new()).unwrap();
            let (all, _) = read_f32(&path).unwrap();
            let mut seen = Vec::new();
            for_each_f32(&path, |i, name, t| {
                assert_eq!(name, all[i].0);
                assert!(t.equal(&all[i].1), "{name} (bf16 {bf16})");
                seen.push(name.to_string());
                Ok(())
            })
            .unwrap();
            assert_eq!(seen.len(), tensors.len());
        }
        // A file cut short is an error, not a short read.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        assert!(for_each_f32(&path, |_, _, _| Ok(())).is_err());
        let _ = std::fs::remove_file(&path);
    }
}
