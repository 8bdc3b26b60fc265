//! What a driver sets on an [`Engine`] after construction (listen addresses, trusted relays)
//! and what it may read of one: its identity, run, metrics, [`Status`] and peer standing.

use super::*;

/// Where an engine stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub synced: bool,
    pub version: u64,
    pub digest: Digest,
    pub applying: Option<u64>,
}

impl Engine {
    /// Listen addresses and capabilities announced in Hello.
    pub fn set_listen(&mut self, listen: Vec<String>, capabilities: u64) {
        let l = &self.run.limits;
        self.listen = listen
            .into_iter()
            .take(l.max_listen_addrs as usize)
            .filter(|a| a.len() <= l.max_addr_len as usize)
            .collect();
        self.capabilities = capabilities;
    }

    /// The peers this node may use as first-hop relays (see [`caps::RELAY`]); at most two of
    /// them, connected and announcing the capability, are used.
    pub fn set_trusted_relays(&mut self, peers: impl IntoIterator<Item = NodeId>) {
        self.trusted_relays = peers.into_iter().take(16).collect();
    }

    pub fn node_id(&self) -> NodeId {
        self.me_id
    }
    /// This identity's proof of work for the run (0 when the run requires none).
    pub fn pow(&self) -> u64 {
        self.pow
    }
    pub fn run_id(&self) -> RunId {
        self.run_id
    }
    pub fn run(&self) -> &RunConfig {
        &self.run
    }
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
    pub fn status(&self) -> Status {
        Status {
            synced: self.sync == SyncState::Synced,
            version: self.version,
            digest: self.digest,
            applying: self.applying,
        }
    }
    pub fn is_banned(&self, peer: &NodeId) -> bool {
        self.peers.get(peer).is_some_and(|p| p.banned)
    }
    pub fn score(&self, peer: &NodeId) -> u32 {
        self.peers.get(peer).map_or(0, |p| p.score)
    }
}
