//! The simulator: many real protocol engines (or, at scale, a flow model of them) and
//! trainers over a seeded discrete-event network, in one deterministic process.
//!
//! * `net`: per-node upload/download serialization, latency + jitter, loss, partitions.
//! * `world`: engine mode — a real `protocol::engine::Engine` per node on the engines' network
//!   (`protocol::testnet`, shared with the protocol's tests) over `net`; trainers, attackers, faults.
//! * `flow`: flow mode — thousands of nodes, the engine's inclusion rule without its crypto.
//! * `synth`: the `SimTrainer` trait, the synthetic trainer (known optimum, real update layout
//!   and sparsity) and its AdamW all-reduce baseline.
//! * `tiny` (feature `torch`): the real `train` crate as a trainer — what `swarm run` computes.
//! * `adversary`: hostile peers (noise, sign flip, ALIE, IPM, copies, equivocation, malformed
//!   frames, Sybils, ...): what each sends instead of its honest update.
//! * `worked`: the seed article's worked example, analytic and simulated.
//! * `scenario`: TOML scenario files; `metrics`: what is measured (JSON; `swarm plot` draws it).
//!
//! Nothing here reads a clock or global randomness: the same scenario and seed give the same
//! metrics, byte for byte.

pub mod adversary;
mod error;
pub mod flow;
pub mod metrics;
pub mod net;
pub mod rng;
pub mod scenario;
pub mod synth;
#[cfg(feature = "torch")]
pub mod tiny;
pub mod worked;
pub mod world;

pub use error::{ScenarioError, SimError};
pub use metrics::Metrics;
pub use scenario::{Mode, Scenario};

/// Run a scenario in the mode it names. `progress(step, steps)` is called as virtual time
/// passes each step boundary.
pub fn run(sc: &Scenario, progress: &mut dyn FnMut(u64, u64)) -> Result<Metrics, SimError> {
    match sc.mode {
        Mode::Engine => world::World::new(sc)?.run(progress),
        Mode::Flow => Ok(flow::run(sc, progress)),
    }
}
