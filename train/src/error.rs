//! What can go wrong in training: one variant per kind of failure, with what it concerns (a
//! path, a tensor, the numbers that disagree) and, where another error caused it, that error
//! as its `source`.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::run::Optimizer;

/// Why training, its data, a checkpoint or a device could not be used. The data, checkpoint,
/// config and device errors print as they are (`transparent`): each message begins with its
/// category (`data: `, `checkpoint: `, ...) and names the error that caused it, which is also
/// its source.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Why a run's training data could not be opened.
#[derive(Debug, Error)]
pub enum DataError {
    /// A text or token run was started without its file.
    #[error("data: this run trains on a file: pass it with --data PATH")]
    NoFile,
    /// The corpus could not be opened, read or mapped.
    #[error("data: {path}: {source}")]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The tokenizer file could not be loaded.
    #[error("data: {path}: {source}")]
    Tokenizer {
        path: PathBuf,
        source: tokenizers::Error,
    },
    /// A text corpus for a tokenizer is not UTF-8.
    #[error("data: {path}: not UTF-8: {source}")]
    NotUtf8 {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
    /// The tokenizer failed on the corpus.
    #[error("data: tokenizing {path}: {source}")]
    Tokenize {
        path: PathBuf,
        source: tokenizers::Error,
    },
    /// A token shard of a width other than 16 or 32 bits.
    #[error("data: token width {0} (expected 16 or 32)")]
    TokenWidth(u32),
    /// Too few tokens to train and evaluate on (`describe` says which corpus).
    #[error("data: {describe}: only {tokens} tokens")]
    TooShort { describe: String, tokens: usize },
}

/// Why a checkpoint or a model directory could not be read, written or used.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint: {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not a readable or writable safetensors file.
    #[error("checkpoint: {path}: {source}")]
    Safetensors {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
    /// Not valid JSON (a model directory's `config.json` or shard index).
    #[error("checkpoint: {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A tensor of a type swarm does not read.
    #[error("checkpoint: {path}: {tensor}: dtype {dtype:?} (expected F32, BF16 or F16)")]
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: safetensors::Dtype,
    },
    /// A tensor's data runs past the end of the file.
    #[error("checkpoint: {path}: {tensor}: data past the end of the file")]
    PastEnd { path: PathBuf, tensor: String },
    /// A tensor's value count is not its shape's.
    #[error("checkpoint: {path}: {tensor}: {values} values for shape {shape:?}")]
    ValueCount {
        path: PathBuf,
        tensor: String,
        values: usize,
        shape: Vec<i64>,
    },
    /// A shard index (`model.safetensors.index.json`) without its `weight_map`.
    #[error("checkpoint: {path}: no weight_map")]
    NoWeightMap { path: PathBuf },
    /// An HF `config.json` that swarm's Llama cannot follow.
    #[error("checkpoint: config.json: {0}")]
    HfConfig(HfConfigError),
    /// The model configuration a checkpoint's metadata carries does not parse.
    #[error("checkpoint: {} metadata: {source}", crate::hf::MODEL_META)]
    ModelMeta { source: serde_json::Error },
    #[error("checkpoint: no tensor \"tok_embeddings.weight\": not a swarm checkpoint")]
    NotSwarm,
    /// Tensor shapes of no named model, and no configuration in the file's metadata.
    #[error(
        "checkpoint: the tensor shapes (vocab {vocab}, dim {dim}, {layers} layers) match no \
         named model (tiny, small, 1.2b); pass the run file (--run RUN.toml) that trained it"
    )]
    UnknownModel { vocab: u32, dim: i64, layers: usize },
    /// A tensor of the model is not in the checkpoint.
    #[error("checkpoint: missing tensor {0}")]
    MissingTensor(String),
    /// A tensor's shape is not the model's.
    #[error("checkpoint: {tensor}: shape {have:?}, the model's is {want:?}")]
    Shape {
        tensor: String,
        have: Vec<i64>,
        want: Vec<i64>,
    },
    /// More tensors than the model has.
    #[error("checkpoint: {have} tensors, the model has {want}")]
    TensorCount { have: usize, want: usize },
    #[error("checkpoint: no HF name for {0}")]
    NoHfName(String),
    /// A tensor of the model is not in an HF model directory.
    #[error("checkpoint: {dir}: no tensor {tensor}")]
    NoHfTensor { dir: PathBuf, tensor: String },
}

impl CheckpointError {
    /// `path` could not be opened or read (for `map_err`).
    pub(crate) fn io(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
        move |source| CheckpointError::Io {
            path: path.into(),
            source,
        }
    }

    /// `path` is not a readable (or writable) safetensors file (for `map_err`).
    pub(crate) fn safetensors(
        path: &Path,
    ) -> impl Fn(safetensors::SafeTensorError) -> CheckpointError + '_ {
        move |source| CheckpointError::Safetensors {
            path: path.into(),
            source,
        }
    }

    /// `path` is not valid JSON (for `map_err`).
    pub(crate) fn json(path: &Path) -> impl Fn(serde_json::Error) -> CheckpointError + '_ {
        move |source| CheckpointError::Json {
            path: path.into(),
            source,
        }
    }

    /// Tensor `tensor` of `path` has a type swarm does not read (for `map_err`).
    pub(crate) fn dtype<'a>(
        path: &'a Path,
        tensor: &'a str,
    ) -> impl Fn(safetensors::Dtype) -> CheckpointError + 'a {
        move |dtype| CheckpointError::Dtype {
            path: path.into(),
            tensor: tensor.into(),
            dtype,
        }
    }
}

/// What in an HF `config.json` swarm's Llama cannot follow.
#[derive(Debug, Error)]
pub enum HfConfigError {
    /// A required integer is missing or out of range.
    #[error("missing or bad {0:?}")]
    Field(&'static str),
    #[error("model_type {0:?}: only Llama models (model_type \"llama\") convert")]
    NotLlama(String),
    /// `attention_bias` or `mlp_bias` is set.
    #[error("{0} is true; swarm's Llama has no biases")]
    Bias(&'static str),
    #[error("hidden_act {0:?}; swarm's MLP is SwiGLU (silu)")]
    Activation(String),
    #[error("RoPE scaling {0:?}; swarm implements the plain rotary embedding only")]
    RopeScaling(String),
    #[error("hidden_size {dim} is not a multiple of {heads} heads")]
    HeadSplit { dim: u32, heads: u32 },
    #[error("head_dim {head_dim} differs from hidden_size / heads = {derived}; swarm derives it")]
    HeadDim { head_dim: u64, derived: u32 },
    #[error("{heads} heads do not group over {kv_heads} KV heads")]
    KvHeads { heads: u32, kv_heads: u32 },
}

/// Why a training run's options cannot run.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("config: replicas, steps and batch must be at least 1")]
    ZeroCount,
    #[error("config: data vocabulary {data} exceeds the model's {model}")]
    VocabTooLarge { data: usize, model: u32 },
    /// Fewer batches than one protocol step's window of local steps.
    #[error("config: {steps} steps is less than one window of {window} local steps")]
    ShorterThanWindow { steps: u32, window: u32 },
    /// The run's state (`need` bytes) exceeds the free memory (`avail` bytes) on the CPU.
    #[error(
        "config: {model} with {replicas} {optimizer:?} replicas needs about {:.1} GB for \
         weights, gradients and optimizer state, but only {:.1} GB is free; use fewer \
         --replicas, a smaller --model, or --device cuda",
        gb(*.need),
        gb(*.avail)
    )]
    OutOfMemory {
        model: String,
        replicas: usize,
        optimizer: Optimizer,
        need: u64,
        avail: u64,
    },
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// Why a `--device` cannot be used.
#[derive(Debug, Error)]
pub enum DeviceError {
    #[error(
        "device: --device cuda, but libtorch sees no CUDA device (is libtorch_cuda linked and \
         a driver present?)"
    )]
    NoCuda,
    /// `cuda:N` with an `N` that is not a number.
    #[error("device: bad device {device:?}")]
    BadIndex {
        device: String,
        source: std::num::ParseIntError,
    },
    /// `cuda:N` past the devices libtorch sees.
    #[error("device: {device}: only {count} CUDA devices")]
    NoSuchCuda { device: String, count: i64 },
    #[error("device: unknown device {0:?} (expected auto, cpu, cuda or cuda:N)")]
    Unknown(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn messages_name_what_and_where_and_keep_the_cause() {
        let missing = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = TrainError::from(DataError::Unreadable {
            path: "corpus.txt".into(),
            source: missing(),
        });
        assert_eq!(e.to_string(), format!("data: corpus.txt: {}", missing()));
        // Transparent: the category's message is the error's, the I/O error its source.
        assert_eq!(
            e.source().expect("a source").to_string(),
            missing().to_string()
        );

        let e = TrainError::from(ConfigError::OutOfMemory {
            model: "small".into(),
            replicas: 4,
            optimizer: Optimizer::Demo,
            need: 12_340_000_000,
            avail: 2_000_000_000,
        });
        assert_eq!(
            e.to_string(),
            "config: small with 4 Demo replicas needs about 12.3 GB for weights, gradients and \
             optimizer state, but only 2.0 GB is free; use fewer --replicas, a smaller --model, \
             or --device cuda"
        );

        let bad_json = serde_json::from_str::<u32>("x").expect_err("not JSON");
        let e = CheckpointError::ModelMeta { source: bad_json };
        assert!(e
            .to_string()
            .starts_with("checkpoint: swarm.model metadata: "));

        let e = CheckpointError::HfConfig(HfConfigError::Field("hidden_size"));
        assert_eq!(
            e.to_string(),
            "checkpoint: config.json: missing or bad \"hidden_size\""
        );
        assert!(e.source().is_none());

        let e = DeviceError::Unknown("tpu".into());
        assert_eq!(
            e.to_string(),
            "device: unknown device \"tpu\" (expected auto, cpu, cuda or cuda:N)"
        );
    }
}
