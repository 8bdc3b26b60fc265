//! The `swarm` node as a library: the libp2p networking, and the event loop of `swarm run`
//! (`cmd_net::run`), which tests start in-process on libp2p's memory transport.

pub mod cmd_net;
pub mod hostile;
pub mod iplimit;
pub mod metrics;
pub mod net;
pub mod status;
pub mod trainer;
pub mod tui;

pub use cmd_net::{run, NodeConfig, Role};
pub use net::Transport;
