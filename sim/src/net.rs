//! The network model: per-node access links with their own upload and download rates, one-way
//! latency and jitter, random loss, and partitions that heal.
//!
//! Every node sits behind an access link to a core with unlimited capacity (the usual model of
//! home and datacentre links: the bottleneck is the edge). A message of `b` bytes from `a` to
//! `z` is serialized on `a`'s uplink (one message at a time, at `a`'s upload rate, in the order
//! sent), crosses the core in `lat(a) + lat(z) + jitter`, and is serialized on `z`'s downlink
//! (one at a time, at `z`'s download rate). Transfers are cut-through: the downlink may start
//! as soon as the first byte arrives, but cannot finish before the last byte left the uplink
//! plus the latency; so a transfer between a 10 Mbit/s uplink and a 100 Mbit/s downlink takes
//! the uplink's time, not the sum of both. The uplink is FIFO (a megabyte blob ahead of a
//! header delays it, as in one QUIC connection's congestion window). The downlink is reserved
//! for each message's own serialization time, in the order messages were sent, so ten 10 Mbit/s
//! senders can fill one 100 Mbit/s downlink at once (an approximation of fair sharing that
//! keeps each transfer O(1); it can misorder reservations of messages sent at different times).

use serde::{Deserialize, Serialize};

use crate::rng::Rng;
use protocol::testnet::{Links, Micros};

/// One node's access link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LinkProfile {
    pub up_mbit: f64,
    pub down_mbit: f64,
    /// One-way latency from the node to the core, ms (a path costs both ends' latency).
    pub latency_ms: f64,
    /// Extra one-way delay, uniform in [0, jitter_ms), per message.
    pub jitter_ms: f64,
    /// Probability that a message leaving or entering this node is lost.
    pub loss: f64,
}

impl Default for LinkProfile {
    fn default() -> Self {
        // The seed article's worked example: 100 Mbit/s down, 10 Mbit/s up.
        LinkProfile {
            up_mbit: 10.0,
            down_mbit: 100.0,
            latency_ms: 20.0,
            jitter_ms: 5.0,
            loss: 0.0,
        }
    }
}

impl LinkProfile {
    /// Microseconds to push `bytes` through `mbit` Mbit/s (rounded up: never free).
    pub fn serialize_us(bytes: u64, mbit: f64) -> Micros {
        if mbit <= 0.0 {
            return Micros::MAX / 4;
        }
        ((bytes as f64 * 8.0) / mbit).ceil() as Micros
    }
}

/// Nodes `[lo, hi)` are cut off from the rest between `from` and `until` (µs of virtual time).
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    pub from: Micros,
    pub until: Micros,
    pub lo: usize,
    pub hi: usize,
}

impl Partition {
    fn separates(&self, a: usize, b: usize, t: Micros) -> bool {
        t >= self.from
            && t < self.until
            && ((self.lo..self.hi).contains(&a) != (self.lo..self.hi).contains(&b))
    }
}

/// Why a message did not arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lost {
    Random,
    Partition,
    Down,
}

pub struct Network {
    pub links: Vec<LinkProfile>,
    up_free: Vec<Micros>,
    down_free: Vec<Micros>,
    /// Nodes whose link is down (crashed or left): nothing in, nothing out.
    pub down: Vec<bool>,
    pub partitions: Vec<Partition>,
    rng: Rng,
    /// Bytes that left / entered each node's link since the last `take_counters`.
    pub up_bytes: Vec<u64>,
    pub down_bytes: Vec<u64>,
    pub messages: u64,
    pub lost: u64,
}

impl Network {
    pub fn new(links: Vec<LinkProfile>, seed: u64) -> Network {
        let n = links.len();
        Network {
            links,
            up_free: vec![0; n],
            down_free: vec![0; n],
            down: vec![false; n],
            partitions: Vec::new(),
            rng: Rng::new(seed ^ 0x6e65_7477_6f72_6b),
            up_bytes: vec![0; n],
            down_bytes: vec![0; n],
            messages: 0,
            lost: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.links.len()
    }
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    /// A new node (a joiner): returns its index.
    pub fn add(&mut self, link: LinkProfile) -> usize {
        self.links.push(link);
        self.up_free.push(0);
        self.down_free.push(0);
        self.down.push(false);
        self.up_bytes.push(0);
        self.down_bytes.push(0);
        self.links.len() - 1
    }

    /// A node went down or came back; its queues empty (what was in flight is gone).
    pub fn set_down(&mut self, node: usize, down: bool, now: Micros) {
        self.down[node] = down;
        self.up_free[node] = now;
        self.down_free[node] = now;
    }

    /// Send `bytes` from `a` to `z` at `now`: the arrival time, or why it was lost. A lost
    /// message still used the sender's uplink (it was sent; the path dropped it).
    pub fn send(&mut self, a: usize, z: usize, bytes: u64, now: Micros) -> Result<Micros, Lost> {
        self.messages += 1;
        if self.down[a] {
            self.lost += 1;
            return Err(Lost::Down);
        }
        let (la, lz) = (&self.links[a], &self.links[z]);
        let up_start = now.max(self.up_free[a]);
        let up_end = up_start + LinkProfile::serialize_us(bytes, la.up_mbit);
        self.up_free[a] = up_end;
        self.up_bytes[a] += bytes;
        let jitter = la.jitter_ms + lz.jitter_ms;
        let lat = ((la.latency_ms
            + lz.latency_ms
            + if jitter > 0.0 {
                self.rng.unit() * jitter
            } else {
                0.0
            })
            * 1000.0) as Micros;
        let loss = 1.0 - (1.0 - la.loss) * (1.0 - lz.loss);
        if self.rng.chance(loss) {
            self.lost += 1;
            return Err(Lost::Random);
        }
        if self.partitions.iter().any(|p| p.separates(a, z, up_start)) {
            self.lost += 1;
            return Err(Lost::Partition);
        }
        if self.down[z] {
            self.lost += 1;
            return Err(Lost::Down);
        }
        // The downlink is reserved only for its own serialization time, not for the whole
        // trickle of a slow sender: many slow uplinks can then fill one fast downlink together.
        let down_start = (up_start + lat).max(self.down_free[z]);
        let busy_end = down_start + LinkProfile::serialize_us(bytes, lz.down_mbit);
        self.down_free[z] = busy_end;
        self.down_bytes[z] += bytes;
        Ok(busy_end.max(up_end + lat))
    }

    /// Round-trip-ish delay for a lost request to be noticed (the transport's timeout).
    pub fn path_latency_us(&self, a: usize, z: usize) -> Micros {
        ((self.links[a].latency_ms + self.links[z].latency_ms) * 1000.0) as Micros
    }

    /// Per-node byte counters since the last call, reset.
    pub fn take_counters(&mut self) -> (Vec<u64>, Vec<u64>) {
        let n = self.links.len();
        (
            std::mem::replace(&mut self.up_bytes, vec![0; n]),
            std::mem::replace(&mut self.down_bytes, vec![0; n]),
        )
    }
}

/// The engines' network (`protocol::testnet`) sends over these links.
impl Links for Network {
    fn send(&mut self, from: usize, to: usize, bytes: u64, now: Micros) -> Option<Micros> {
        Network::send(self, from, to, bytes, now).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(up: f64, down: f64) -> LinkProfile {
        LinkProfile {
            up_mbit: up,
            down_mbit: down,
            latency_ms: 0.0,
            jitter_ms: 0.0,
            loss: 0.0,
        }
    }

    #[test]
    fn uplink_serializes_and_cut_through_takes_the_slower_side() {
        let mut n = Network::new(
            vec![link(10.0, 100.0), link(10.0, 100.0), link(10.0, 100.0)],
            1,
        );
        // 1.25 MB at 10 Mbit/s: 1 s on the uplink; the 100 Mbit/s downlink does not add to it.
        let a = n.send(0, 1, 1_250_000, 0).unwrap();
        assert_eq!(a, 1_000_000);
        // A second copy waits for the first on the same uplink.
        let b = n.send(0, 2, 1_250_000, 0).unwrap();
        assert_eq!(b, 2_000_000);
        // Two senders into one downlink: the second reserves the downlink after the first
        // (0.1 s each at 100 Mbit/s) but is bounded by its own uplink's 1 s, not delayed by it.
        let c = n.send(1, 2, 1_250_000, 0).unwrap();
        assert_eq!(c, 1_200_000);
    }

    #[test]
    fn partitions_cut_and_heal() {
        let mut n = Network::new(vec![link(100.0, 100.0); 4], 1);
        n.partitions.push(Partition {
            from: 10,
            until: 100,
            lo: 0,
            hi: 2,
        });
        assert!(n.send(0, 1, 100, 15).is_ok());
        assert_eq!(n.send(0, 3, 100, 15), Err(Lost::Partition));
        assert!(n.send(0, 3, 100, 200).is_ok());
    }
}
