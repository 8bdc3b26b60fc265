//! Whole nodes in one process: `node::run` on libp2p's memory transport (tiny model, CPU, one
//! libtorch thread), each node a tokio task with its own trainer thread, stopped through its
//! shutdown future. The tests watch the nodes through their status lines
//! (`NodeConfig::observer`) and wait, with generous deadlines, for conditions (a node at step
//! N, the same digest everywhere), never for exact timings.
//!
//! * churn: a node stopped at step 3 and started again with the same key and checkpoint
//!   directory resumes and syncs again; a node that starts at step 5 gets a checkpoint from its
//!   peers; both agree with everyone after every step they apply;
//! * a sign-flipping node (`Adversary::Signflip`) is penalized and left out, and the honest
//!   nodes agree after every step.
//!
//! What only real processes show (kill -9, network namespaces) stays in `faults.rs` and
//! `netns.rs`.

// A test: an unwrap that fails is a failing test, with its line (helpers included).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crypto::Identity;
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use node::cmd_net::now_ms;
use node::status::StatusLine;
use node::{NodeConfig, Transport};
use protocol::run::RunConfig;
use tokio::sync::{mpsc, oneshot};

/// The tests share two cores: one swarm at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TINY_LOCAL: &str = include_str!("../runs/tiny-local.toml");

/// Memory-transport ports are process-wide: each swarm takes its own range.
fn ports() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = 1_000_000 + (std::process::id() as u64 % 1000) * 10_000;
    base + NEXT.fetch_add(100, Ordering::Relaxed)
}

/// A running node: dropping it (or `stop`) completes its shutdown future.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Stop the node and wait until `node::run` has returned (its trainer thread included).
    async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.take().map(|s| s.send(()));
        (&mut self.task).await.expect("the node task")
    }
}

/// A swarm of in-process nodes of one run, and every status line they write.
struct Local {
    run: RunConfig,
    ports: u64,
    tx: mpsc::UnboundedSender<StatusLine>,
    rx: mpsc::UnboundedReceiver<StatusLine>,
    /// Status lines by node (peer id) and step; a restarted node's later line of a step wins.
    lines: BTreeMap<String, BTreeMap<u64, StatusLine>>,
    /// Nodes started so far, counting restarts.
    starts: u64,
}

impl Local {
    /// `tiny-local` with steps every `period_ms` (grace and summary windows scaled as in
    /// `swarm demo`), starting `start_in_ms` from now; `edit` changes the run further.
    fn new(period_ms: u64, start_in_ms: u64, edit: impl FnOnce(&mut String)) -> Local {
        // RUST_LOG=info shows every node's log (interleaved) with a failing test's output.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let mut text = TINY_LOCAL.to_string();
        edit(&mut text);
        let mut run: RunConfig = toml::from_str(&text).unwrap();
        run.timing.period_ms = period_ms;
        run.timing.grace_ms = period_ms * 4 / 25;
        run.timing.summary_ms = period_ms * 8 / 25;
        run.timing.genesis_ms = now_ms() + start_in_ms;
        run.validate().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        Local {
            run,
            ports: ports(),
            tx,
            rx,
            lines: BTreeMap::new(),
            starts: 0,
        }
    }

    fn id(i: u64) -> Identity {
        let mut seed = [7u8; 32];
        seed[..8].copy_from_slice(&i.to_le_bytes());
        Identity::from_seed(seed)
    }

    /// Node `i`'s peer id (its status lines' `node`).
    fn name(i: u64) -> String {
        Self::id(i).node_id().peer_id_string()
    }

    /// The first node's address.
    fn bootstrap(&self) -> Multiaddr {
        let a: Multiaddr = format!("/memory/{}", self.ports).parse().unwrap();
        a.with(Protocol::P2p(
            libp2p::PeerId::from_bytes(&Self::id(0).node_id().peer_id_bytes()).unwrap(),
        ))
    }

    /// Start node `i` (the same key every time, so a restart is the same node); node 0 is
    /// everyone's bootstrap peer, at port `ports`. Every start listens on a port of its own:
    /// the memory transport keeps a port taken after its swarm is dropped.
    fn start(&mut self, i: u64, edit: impl FnOnce(&mut NodeConfig)) -> Running {
        let mut cfg = NodeConfig::new(self.run.clone(), Self::id(i));
        cfg.listen = vec![format!("/memory/{}", self.ports + self.starts)
            .parse()
            .unwrap()];
        self.starts += 1;
        if i != 0 {
            cfg.bootstrap = vec![self.bootstrap()];
        }
        cfg.threads = Some(1);
        cfg.observer = Some(self.tx.clone());
        edit(&mut cfg);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(node::run(cfg, Transport::Memory, async move {
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task,
        }
    }

    /// Take the status lines written so far.
    fn collect(&mut self) {
        while let Ok(l) = self.rx.try_recv() {
            self.lines
                .entry(l.node.clone())
                .or_default()
                .insert(l.step, l);
        }
    }

    fn of(&self, i: u64) -> BTreeMap<u64, StatusLine> {
        self.lines.get(&Self::name(i)).cloned().unwrap_or_default()
    }

    fn last_step(&self, i: u64) -> Option<u64> {
        self.lines
            .get(&Self::name(i))
            .and_then(|m| m.keys().next_back().copied())
    }

    /// Wait (up to `secs`) until `done` holds of the lines so far.
    async fn until(&mut self, secs: u64, what: &str, mut done: impl FnMut(&Local) -> bool) {
        let t0 = Instant::now();
        loop {
            self.collect();
            if done(self) {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}: last steps {:?}",
                self.lines
                    .iter()
                    .map(|(n, m)| (&n[n.len() - 6..], m.keys().next_back()))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Every step both applied has the same digest; returns how many they share.
fn agree(a: &BTreeMap<u64, StatusLine>, b: &BTreeMap<u64, StatusLine>, who: &str) -> usize {
    let mut n = 0;
    for (s, l) in a {
        if let Some(m) = b.get(s) {
            assert_eq!(l.digest, m.digest, "{who}: digests differ at step {s}");
            n += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_and_a_late_joiner_sync_on_the_swarms_digest() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut l = Local::new(2000, 6000, |_| {});
    let ck = std::env::temp_dir().join(format!("swarm-inproc-churn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ck);
    let (steps, last) = (14, 13);
    let with_dir = |c: &mut NodeConfig| {
        c.steps = Some(steps);
        c.checkpoint_dir = Some(ck.clone());
    };
    let mut nodes: Vec<Running> = (0..3)
        .map(|i| l.start(i, |c| c.steps = Some(steps)))
        .collect();
    let victim = l.start(3, with_dir);

    // Node 3 stops through its shutdown and starts again with its checkpoint directory.
    l.until(60, "step 2 at node 3", |l| l.last_step(3) >= Some(2))
        .await;
    victim.stop().await.expect("node 3 stops cleanly");
    l.collect();
    let stopped_at = l.last_step(3).unwrap();
    nodes.push(l.start(3, with_dir));

    // A node that was not there at all starts once the swarm is at step 5.
    l.until(60, "step 5 at node 0", |l| l.last_step(0) >= Some(5))
        .await;
    let joined_at = now_ms();
    nodes.push(l.start(4, |c| c.steps = Some(steps)));

    l.until(90, "the last step everywhere", |l| {
        (0..5).all(|i| l.last_step(i) >= Some(last))
    })
    .await;
    let n: Vec<BTreeMap<u64, StatusLine>> = (0..5).map(|i| l.of(i)).collect();
    for i in 1..5 {
        agree(&n[0], &n[i], &format!("node 0 vs node {i}"));
    }
    // The restarted node applied steps again, caught up to the end, each agreeing.
    let after: Vec<u64> = n[3].keys().copied().filter(|s| *s > stopped_at).collect();
    assert!(
        after.len() >= 4,
        "node 3 applied {after:?} after its restart"
    );
    // The joiner loaded a checkpoint (it never applied the early steps) and then applied every
    // step to the last, each agreeing with everyone.
    let first = *n[4].keys().next().unwrap();
    assert!(first >= 5, "the joiner's first applied step is {first}");
    assert!(n[4].values().all(|x| x.t_ms >= joined_at));
    assert_eq!(n[4].len() as u64, last - first + 1, "{:?}", n[4].keys());
    for i in 0..4 {
        assert_eq!(
            agree(&n[4], &n[i], &format!("joiner vs node {i}")),
            n[4].len()
        );
    }
    // Once in, their updates count: the last step includes all five nodes.
    assert_eq!(n[0][&last].included, 5, "{:?}", n[0][&last]);
    for r in nodes {
        r.stop().await.expect("a node ends cleanly");
    }
    let _ = std::fs::remove_dir_all(&ck);
}

/// Issue 6 in one process: four honest nodes and one that publishes sign-flipped updates,
/// with every content defence on and bounded-influence combining. The honest nodes
/// spot-check it, penalize it and leave its updates out, and agree after every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sign_flipping_node_is_penalized_and_left_out() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut l = Local::new(2000, 6000, |t| {
        *t = t.replace("grad_clip = 1.0", "grad_clip = 1.0\ncombine = \"share\"");
        t.push_str("\n[defence]\nmajority = true\nspot_checks = 2\ncopy_overlap_permille = 900\npow_bits = 8\nprobation_steps = 4\n");
    });
    let (steps, last) = (14, 13);
    let mut nodes: Vec<Running> = (0..4)
        .map(|i| l.start(i, |c| c.steps = Some(steps)))
        .collect();
    nodes.push(l.start(4, |c| {
        c.steps = Some(steps);
        c.adversary = Some(node::hostile::Adversary::Signflip);
    }));
    l.until(90, "the last step at the honest nodes", |l| {
        (0..4).all(|i| l.last_step(i) >= Some(last))
    })
    .await;
    let n: Vec<BTreeMap<u64, StatusLine>> = (0..4).map(|i| l.of(i)).collect();
    for i in 1..4 {
        assert_eq!(
            agree(&n[0], &n[i], &format!("node 0 vs node {i}")),
            n[0].len()
        );
    }
    // Penalized: nobody else misbehaves, so every penalty is the hostile node's.
    let blamed = n.iter().filter(|x| x[&last].penalties > 0).count();
    assert!(blamed >= 3, "{blamed} of 4 honest nodes penalized anyone");
    // Left out: the last steps include exactly the four honest updates.
    for s in last - 3..=last {
        for (i, x) in n.iter().enumerate() {
            assert_eq!(x[&s].included, 4, "node {i} step {s}: {:?}", x[&s]);
        }
    }
    for r in nodes {
        r.stop().await.expect("a node ends cleanly");
    }
}
