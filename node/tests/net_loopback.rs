//! Three in-process libp2p swarms on loopback: one publishes a gossip frame that the others
//! receive and validate manually (forwarding waits for the verdict), one fetches a blob by id
//! from another over request-response, and an oversize response is cut off by the codec cap.

// A test: an unwrap that fails is a failing test, with its line (helpers included).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use crypto::ContentId;
use futures::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::swarm::SwarmEvent;
use libp2p::{request_response, Multiaddr, PeerId, Swarm};
use node::net::{build_swarm, Behaviour, BehaviourEvent, NetConfig, Request};

fn config() -> NetConfig {
    NetConfig {
        max_transmit: 8 * 1024,
        max_request: 1024,
        max_response: 16 * 1024,
        topic: Some("swarm/test/v1".into()),
        max_connections: 16,
        request_timeout: Duration::from_secs(5),
        max_per_ip: node::net::MAX_PER_IP,
        exempt_loopback: true,
        mesh: node::net::DEFAULT_MESH,
    }
}

struct Node {
    swarm: Swarm<Behaviour>,
    addr: Multiaddr,
    /// What this node serves by blob id.
    blobs: HashMap<ContentId, Vec<u8>>,
    got: Vec<Vec<u8>>,
    fetched: Vec<Result<Vec<u8>, String>>,
}

async fn node() -> Node {
    node_with(&config()).await
}

async fn node_with(cfg: &NetConfig) -> Node {
    let key = libp2p::identity::Keypair::generate_ed25519();
    let mut reg = libp2p::metrics::Registry::default();
    let mut swarm = build_swarm(key, cfg, &mut reg).unwrap();
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&IdentTopic::new("swarm/test/v1"))
        .unwrap();
    swarm
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .unwrap();
    let addr = loop {
        if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
            break address;
        }
    };
    Node {
        swarm,
        addr,
        blobs: HashMap::new(),
        got: Vec::new(),
        fetched: Vec::new(),
    }
}

/// Drive one event of node `n`: validate gossip (accept everything starting with "ok"), serve
/// blob requests, record responses.
fn on_event(n: &mut Node, ev: SwarmEvent<BehaviourEvent>) {
    match ev {
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
            propagation_source,
            message_id,
            message,
        })) => {
            let verdict = if message.data.starts_with(b"ok") {
                MessageAcceptance::Accept
            } else {
                MessageAcceptance::Reject
            };
            n.swarm
                .behaviour_mut()
                .gossipsub
                .report_message_validation_result(&message_id, &propagation_source, verdict);
            n.got.push(message.data);
        }
        SwarmEvent::Behaviour(BehaviourEvent::Rr(request_response::Event::Message {
            message,
            ..
        })) => match message {
            request_response::Message::Request {
                request, channel, ..
            } => {
                let resp = match request {
                    Request::Blob(id) => n.blobs.get(&id).cloned().unwrap_or_default(),
                    Request::Frame(_) | Request::Manifest { .. } | Request::Chunk { .. } => {
                        Vec::new()
                    }
                };
                let _ = n.swarm.behaviour_mut().rr.send_response(channel, resp);
            }
            request_response::Message::Response { response, .. } => n.fetched.push(Ok(response)),
        },
        SwarmEvent::Behaviour(BehaviourEvent::Rr(request_response::Event::OutboundFailure {
            error,
            ..
        })) => n.fetched.push(Err(error.to_string())),
        _ => {}
    }
}

/// Poll all nodes until `done` holds (or panic after `secs`).
async fn drive(nodes: &mut [Node], secs: u64, mut done: impl FnMut(&[Node]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !done(nodes) {
        assert!(tokio::time::Instant::now() < deadline, "timed out");
        let evs = {
            let futs = nodes
                .iter_mut()
                .enumerate()
                .map(|(i, n)| Box::pin(async move { (i, n.swarm.select_next_some().await) }));
            tokio::time::timeout(
                Duration::from_millis(100),
                futures::future::select_all(futs),
            )
            .await
        };
        if let Ok(((i, ev), _, _)) = evs {
            on_event(&mut nodes[i], ev);
        }
    }
}

fn mesh_size(n: &Node) -> usize {
    let t = IdentTopic::new("swarm/test/v1").hash();
    n.swarm.behaviour().gossipsub.mesh_peers(&t).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gossip_with_manual_validation_and_blob_fetch() {
    let mut nodes = vec![node().await, node().await, node().await];
    let a_addr = nodes[0].addr.clone();
    let a_id: PeerId = *nodes[0].swarm.local_peer_id();
    // A line: 1 — 0 — 2. Node 2 only hears what node 0 forwards, after node 0 accepted it.
    nodes[1].swarm.dial(a_addr.clone()).unwrap();
    nodes[2].swarm.dial(a_addr).unwrap();
    drive(&mut nodes, 20, |n| {
        mesh_size(&n[0]) == 2 && mesh_size(&n[1]) == 1 && mesh_size(&n[2]) == 1
    })
    .await;

    let topic = IdentTopic::new("swarm/test/v1");
    nodes[1]
        .swarm
        .behaviour_mut()
        .gossipsub
        .publish(topic.clone(), b"ok hello".to_vec())
        .unwrap();
    drive(&mut nodes, 10, |n| !n[2].got.is_empty()).await;
    assert_eq!(nodes[0].got, vec![b"ok hello".to_vec()]);
    assert_eq!(nodes[2].got, vec![b"ok hello".to_vec()]);

    // A rejected message stops at the first validator.
    nodes[1]
        .swarm
        .behaviour_mut()
        .gossipsub
        .publish(topic.clone(), b"bad".to_vec())
        .unwrap();
    drive(&mut nodes, 10, |n| n[0].got.len() == 2).await;
    let quiet = tokio::time::Instant::now() + Duration::from_millis(1500);
    drive(&mut nodes, 10, |_| tokio::time::Instant::now() > quiet).await;
    assert_eq!(
        nodes[2].got.len(),
        1,
        "node 0 must not forward what it rejected"
    );

    // Node 2 fetches a blob from node 0 by id; an unknown id comes back empty.
    let blob = vec![42u8; 10_000];
    let id = ContentId::of(&blob);
    nodes[0].blobs.insert(id, blob.clone());
    nodes[2]
        .swarm
        .behaviour_mut()
        .rr
        .send_request(&a_id, Request::Blob(id));
    nodes[2]
        .swarm
        .behaviour_mut()
        .rr
        .send_request(&a_id, Request::Blob(ContentId([0; 32])));
    drive(&mut nodes, 10, |n| n[2].fetched.len() == 2).await;
    let mut got: Vec<_> = nodes[2].fetched.drain(..).map(|r| r.unwrap()).collect();
    got.sort_by_key(|b| b.len());
    assert_eq!(got, vec![Vec::new(), blob]);

    // A response over the cap fails the fetch instead of being buffered.
    let big = vec![1u8; 20_000];
    let big_id = ContentId::of(&big);
    nodes[0].blobs.insert(big_id, big);
    nodes[2]
        .swarm
        .behaviour_mut()
        .rr
        .send_request(&a_id, Request::Blob(big_id));
    drive(&mut nodes, 10, |n| n[2].fetched.len() == 1).await;
    assert!(
        nodes[2].fetched[0].is_err(),
        "{:?}",
        nodes[2].fetched[0].as_ref().map(|b| b.len())
    );
}

/// Keys dialing in take at most three quarters of a node's connection slots: with one cap for
/// both directions, enough of them eclipsed the node (it could dial nobody of its own choice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialers_cannot_take_the_slots_a_node_keeps_for_its_own_dials() {
    let cfg = NetConfig {
        max_connections: 4,
        ..config()
    };
    assert_eq!(node::net::max_inbound(4), 3);
    let mut nodes = vec![node_with(&cfg).await];
    for _ in 0..5 {
        nodes.push(node().await);
    }
    let target = nodes[0].addr.clone();
    for n in &mut nodes[1..5] {
        n.swarm.dial(target.clone()).unwrap();
    }
    let incoming = |n: &[Node]| {
        n[0].swarm
            .network_info()
            .connection_counters()
            .num_established_incoming()
    };
    drive(&mut nodes, 10, |n| incoming(n) >= 3).await;
    // The fourth dialer is refused, now and a while later.
    let settle = tokio::time::Instant::now() + Duration::from_secs(2);
    drive(&mut nodes, 10, |_| tokio::time::Instant::now() >= settle).await;
    assert_eq!(incoming(&nodes), 3);
    // The node still dials a peer of its own choice.
    let own = nodes[5].addr.clone();
    nodes[0].swarm.dial(own).unwrap();
    drive(&mut nodes, 10, |n| {
        n[0].swarm
            .network_info()
            .connection_counters()
            .num_established_outgoing()
            == 1
    })
    .await;
    assert_eq!(incoming(&nodes), 3);
}

/// Issue 13, item 8: one machine with many keys cannot fill a node's inbound slots. Four
/// dialers from one address (loopback, not exempt here) get two connections; the rest are
/// denied, and the node still dials whom it chooses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_hold_more_than_its_share_of_inbound_connections() {
    let cfg = NetConfig {
        max_per_ip: 2,
        exempt_loopback: false,
        ..config()
    };
    let mut nodes = vec![node_with(&cfg).await];
    for _ in 0..5 {
        nodes.push(node().await);
    }
    let target = nodes[0].addr.clone();
    for n in &mut nodes[1..5] {
        n.swarm.dial(target.clone()).unwrap();
    }
    let incoming = |n: &[Node]| {
        n[0].swarm
            .network_info()
            .connection_counters()
            .num_established_incoming()
    };
    drive(&mut nodes, 10, |n| incoming(n) >= 2).await;
    let settle = tokio::time::Instant::now() + Duration::from_secs(2);
    drive(&mut nodes, 10, |_| tokio::time::Instant::now() >= settle).await;
    assert_eq!(incoming(&nodes), 2);
    let own = nodes[5].addr.clone();
    nodes[0].swarm.dial(own).unwrap();
    drive(&mut nodes, 10, |n| {
        n[0].swarm
            .network_info()
            .connection_counters()
            .num_established_outgoing()
            == 1
    })
    .await;
    assert_eq!(incoming(&nodes), 2);
}
