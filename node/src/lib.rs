//! The pieces of the `swarm` node that tests drive in-process: the libp2p networking.

pub mod iplimit;
pub mod metrics;
pub mod net;
