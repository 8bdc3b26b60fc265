//! Training for swarm: a Llama-style model, the data a node trains on, the DeMo optimizer
//! (momentum → chunked DCT → top-k → compact bits → exact aggregate → sign step) and the
//! AdamW + all-reduce baseline it is measured against. Built on tch (libtorch).

pub mod adamw;
pub mod data;
pub mod demo;
pub mod eval;
pub mod hf;
pub mod model;
pub mod node;
pub mod rng;
pub mod run;

pub use tch;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("data: {0}")]
    Data(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("config: {0}")]
    Config(String),
    #[error("device: {0}")]
    Device(String),
}

/// `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<tch::Device, TrainError> {
    match s {
        "auto" => Ok(tch::Device::cuda_if_available()),
        "cpu" => Ok(tch::Device::Cpu),
        "cuda" => {
            if tch::Cuda::is_available() {
                Ok(tch::Device::Cuda(0))
            } else {
                Err(TrainError::Device("--device cuda, but libtorch sees no CUDA device (is libtorch_cuda linked and a driver present?)".into()))
            }
        }
        s if s.starts_with("cuda:") => {
            let n: usize = s[5..]
                .parse()
                .map_err(|_| TrainError::Device(format!("bad device {s:?}")))?;
            if n < tch::Cuda::device_count() as usize {
                Ok(tch::Device::Cuda(n))
            } else {
                Err(TrainError::Device(format!(
                    "{s}: only {} CUDA devices",
                    tch::Cuda::device_count()
                )))
            }
        }
        s => Err(TrainError::Device(format!(
            "unknown device {s:?} (expected auto, cpu, cuda or cuda:N)"
        ))),
    }
}
