//! The seed article's worked example, analytic and simulated: n nodes exchange updates of S
//! bytes over 100 Mbit/s down / 10 Mbit/s up links.
//!
//! All-to-all, each node downloads (n−1)·S: 31 × 2.8 MB at 100 Mbit/s = 6.94 s; uploading S
//! once takes 2.24 s at 10 Mbit/s — the article's figures. But all-to-all *push* makes every
//! node upload n−1 copies (69.4 s): the 2.24 s assumes something else carries the fan-out, an
//! aggregation relay with a fat link (or a gossip mesh that spreads the copies). The simulated
//! rows run the same transfers through `net::Network` (latency 0, so the numbers are pure
//! serialization): all-to-all push, and a relay that forwards each update as it arrives.

use protocol::config::{ModelConfig, ValueCodec};
use protocol::sparse::{encoded_size, Layout};
use serde::Serialize;

use crate::net::{LinkProfile, Network};
use crate::scenario::{Flow, Mode, NodeClass, Policy, Scenario, Timing};

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub case: String,
    pub nodes: usize,
    pub update_bytes: u64,
    /// Analytic seconds (None where the case has no closed form here).
    pub analytic_down_s: Option<f64>,
    pub analytic_up_s: Option<f64>,
    /// Simulated: the slowest node's download time (first to last byte it needed) and upload
    /// time (its uplink busy), seconds.
    pub sim_down_s: f64,
    pub sim_up_s: f64,
    /// Simulated: when the last node held every update, seconds after the step's updates were
    /// ready.
    pub sim_done_s: f64,
}

fn link(up: f64, down: f64) -> LinkProfile {
    LinkProfile {
        up_mbit: up,
        down_mbit: down,
        latency_ms: 0.0,
        jitter_ms: 0.0,
        loss: 0.0,
    }
}

/// The real update size of `1.2b` (k = 4 of 64×64 blocks, 1-bit values).
pub fn size_1_2b() -> u64 {
    let m = ModelConfig::named("1.2b", 0).expect("preset exists");
    encoded_size(&Layout::for_model(&m, 64), 4, ValueCodec::Sign) as u64
}

/// Every node pushes its update to every other at t = 0 (each sender walks the others
/// starting after itself, so no one receiver is everyone's first).
pub fn all_to_all(n: usize, s: u64, up: f64, down: f64) -> (f64, f64, f64) {
    let mut net = Network::new(vec![link(up, down); n], 1);
    let mut last = vec![0u64; n];
    let mut up_busy = vec![0u64; n];
    for round in 1..n {
        for a in 0..n {
            let z = (a + round) % n;
            let t = net.send(a, z, s, 0).expect("lossless");
            last[z] = last[z].max(t);
            up_busy[a] += LinkProfile::serialize_us(s, up);
        }
    }
    let done = *last.iter().max().unwrap_or(&0) as f64 / 1e6;
    (done, *up_busy.iter().max().unwrap_or(&0) as f64 / 1e6, done)
}

/// Every node uploads once to a relay (node n, `relay_mbit` both ways), which forwards each
/// update to the n−1 others as soon as it has it.
pub fn relay(n: usize, s: u64, up: f64, down: f64, relay_mbit: f64) -> (f64, f64, f64) {
    let mut links = vec![link(up, down); n];
    links.push(link(relay_mbit, relay_mbit));
    let mut net = Network::new(links, 1);
    let arrive: Vec<u64> = (0..n)
        .map(|a| net.send(a, n, s, 0).expect("lossless"))
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&a| (arrive[a], a));
    let mut first = vec![u64::MAX; n];
    let mut last = vec![0u64; n];
    for &a in &order {
        for z in (0..n).filter(|&z| z != a) {
            let t = net.send(n, z, s, arrive[a]).expect("lossless");
            first[z] = first[z].min(arrive[a]);
            last[z] = last[z].max(t);
        }
    }
    let down_s = (0..n).map(|z| last[z] - first[z]).max().unwrap_or(0) as f64 / 1e6;
    let up_s = LinkProfile::serialize_us(s, up) as f64 / 1e6;
    (down_s, up_s, *last.iter().max().unwrap_or(&0) as f64 / 1e6)
}

/// Our protocol: announce-then-fetch over a gossip mesh of degree 6 (flow mode, one step,
/// zero latency, zero training time), every update included.
pub fn gossip(n: usize, s: u64, up: f64, down: f64) -> (f64, f64, f64) {
    let sc = Scenario {
        name: "worked-gossip".into(),
        mode: Mode::Flow,
        steps: 1,
        timing: Timing {
            period_ms: 400_000,
            grace_ms: 1000,
            summary_ms: 1000,
        },
        classes: vec![NodeClass {
            count: n,
            link: link(up, down),
            compute_ms: 0,
        }],
        flow: Flow {
            policy: Policy::All,
            header_bytes: 330,
            summary_bytes: 300,
        },
        model: crate::scenario::ModelSpec {
            wire_blob_bytes: s,
            ..Default::default()
        },
        ..Scenario::default()
    };
    let m = crate::flow::run(&sc, &mut |_, _| {});
    let st = &m.steps[0];
    let done = st.latency_max_ms / 1000.0;
    (
        st.down_max as f64 * 8.0 / (down * 1e6),
        st.up_max as f64 * 8.0 / (up * 1e6),
        done,
    )
}

/// The table: the article's 2.8 MB and our 1.2b update size, 32 nodes, 100/10 Mbit/s.
pub fn table() -> Vec<Row> {
    let (n, up, down) = (32usize, 10.0, 100.0);
    let mut rows = Vec::new();
    for s in [2_800_000u64, size_1_2b()] {
        let a_down = (n as f64 - 1.0) * s as f64 * 8.0 / (down * 1e6);
        let a_up1 = s as f64 * 8.0 / (up * 1e6);
        let label = if s == 2_800_000 {
            "article 2.8 MB"
        } else {
            "ours, 1.2b"
        };
        let (d, u, t) = all_to_all(n, s, up, down);
        rows.push(Row {
            case: format!("{label}: all-to-all push"),
            nodes: n,
            update_bytes: s,
            analytic_down_s: Some(a_down),
            analytic_up_s: Some(a_up1 * (n as f64 - 1.0)),
            sim_down_s: d,
            sim_up_s: u,
            sim_done_s: t,
        });
        let (d, u, t) = relay(n, s, up, down, 100_000.0);
        rows.push(Row {
            case: format!("{label}: relay, upload once"),
            nodes: n,
            update_bytes: s,
            analytic_down_s: Some(a_down),
            analytic_up_s: Some(a_up1),
            sim_down_s: d,
            sim_up_s: u,
            sim_done_s: t,
        });
        let (d, u, t) = gossip(n, s, up, down);
        rows.push(Row {
            case: format!("{label}: gossip mesh D=6, fetch by id"),
            nodes: n,
            update_bytes: s,
            analytic_down_s: None,
            analytic_up_s: None,
            sim_down_s: d,
            sim_up_s: u,
            sim_done_s: t,
        });
    }
    rows
}

pub fn markdown(rows: &[Row]) -> String {
    let f = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.2}"));
    let mut s = String::from(
        "| case | nodes | update bytes | analytic down s | analytic up s | sim down s | sim up s | sim all held s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} |\n",
            r.case,
            r.nodes,
            r.update_bytes,
            f(r.analytic_down_s),
            f(r.analytic_up_s),
            r.sim_down_s,
            r.sim_up_s,
            r.sim_done_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproduces_the_articles_figures() {
        let (n, s) = (32, 2_800_000);
        // Relay: each node uploads once (2.24 s) and downloads 31 updates (6.94 s).
        let (d, u, _) = relay(n, s, 10.0, 100.0, 100_000.0);
        assert!((d - 6.944).abs() / 6.944 < 0.02, "download {d}");
        assert!((u - 2.24).abs() / 2.24 < 0.02, "upload {u}");
        // All-to-all push: the uplink carries 31 copies.
        let (_, u, t) = all_to_all(n, s, 10.0, 100.0);
        assert!((u - 69.44).abs() / 69.44 < 0.02, "upload {u}");
        assert!(t >= 69.0 && t < 71.0, "done {t}");
        let b = size_1_2b();
        assert!((1_850_000..2_000_000).contains(&b), "1.2b update {b}");
    }
}
