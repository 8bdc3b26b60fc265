//! The swarm protocol: wire types, validation rules and the sans-IO engine.
//!
//! Nothing in this crate does I/O or depends on tch, tokio or libp2p, so the network shell,
//! the simulator and validators all read the same definitions.

pub mod cbor;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub use engine::download;
pub mod error;
pub mod rng;
pub mod run;
pub mod sparse;
#[cfg(feature = "testnet")]
pub mod testnet;
pub mod wire;
