//! Training for swarm: a Llama-style model, the data a node trains on, the DeMo optimizer
//! (momentum → chunked DCT → top-k → compact bits → exact aggregate → sign step) and the
//! AdamW + all-reduce baseline it is measured against. Built on tch (libtorch).

pub mod adamw;
pub mod data;
pub mod demo;
mod error;
pub mod eval;
pub mod hf;
pub mod model;
pub mod node;
pub mod rng;
pub mod run;

pub use tch;

pub use error::{CheckpointError, ConfigError, DataError, DeviceError, HfConfigError, TrainError};

/// Keep freed tensor memory in the process for the next step instead of handing it back to
/// the system at every free. glibc serves blocks over a (dynamic) threshold as fresh `mmap`s
/// and unmaps them when freed, so each step's codec temporaries fault their pages in again:
/// on `small` that was a third of the encode and most of a 2-update apply (docs/BENCHMARKS.md,
/// "Bounded memory"). With these settings blocks up to 32 MB (glibc's ceiling) come from the
/// heap and the heap is not trimmed, so the process holds what its busiest step needed and
/// reuses it: resident memory is the peak, which the codec bounds. Call once, first thing in
/// `main`, before libtorch allocates. A no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        // Safety: mallopt takes two integers and changes allocator policy only.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
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
                Err(DeviceError::NoCuda.into())
            }
        }
        s if s.starts_with("cuda:") => {
            let n: usize = s[5..].parse().map_err(|source| DeviceError::BadIndex {
                device: s.to_string(),
                source,
            })?;
            if n < tch::Cuda::device_count() as usize {
                Ok(tch::Device::Cuda(n))
            } else {
                Err(DeviceError::NoSuchCuda {
                    device: s.to_string(),
                    count: tch::Cuda::device_count(),
                }
                .into())
            }
        }
        s => Err(DeviceError::Unknown(s.to_string()).into()),
    }
}
