//! An in-memory network of engines (feature `testnet`): the one place where engines' network
//! actions are carried out in virtual time, shared by the protocol's tests and the simulator.
//!
//! It models what the shell's transport does, the way gossipsub and request-response behave:
//! * **Gossip.** A published frame goes to the node's mesh peers. A receiver drops a frame whose
//!   content id it has seen (duplicate suppression), and frames from a peer its engine banned
//!   (the transport refuses them first, so they cannot shadow an honest relay's copy). A new
//!   frame reaches the engine with a tag; when `relay` is on, the node forwards it to its other
//!   mesh peers once its engine's verdict for that tag is `Accept`.
//! * **Fetches.** A blob request travels to the holder, which answers with its engine's
//!   [`Engine::serve_update`] (or what its [`Host`] serves instead); a dead, unknown or
//!   cut-off peer fails after `timeout`, a holder without the blob answers "not here" at once.
//! * **Checkpoint requests.** A request reaches the server's engine as `Event::Requested`
//!   (after a snapshot, for a manifest request), and its `Respond` travels back.
//!
//! Everything else an engine asks for (training, applying, spot checks, reports, bans, chunk
//! frames, loading checkpoints) is its [`Host`]'s: a hash-chain trainer in the protocol's tests,
//! real or synthetic trainers and attackers in the simulator. The [`Links`] model says when a
//! message arrives or that it is lost: a fixed delay for the tests, per-node access links with
//! serialization, loss and partitions for the simulator. Time is virtual (µs; engines see ms),
//! and ties are broken in insertion order, so a run is a pure function of its inputs.

pub mod queue;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crypto::{ContentId, NodeId};

use crate::download::Request;
use crate::engine::{Action, Engine, Event, Verdict};

pub use queue::{EventQueue, Micros};

/// When messages between nodes arrive.
pub trait Links {
    /// When `bytes` sent by node `from` to node `to` at `now` arrive; None when they are lost.
    fn send(&mut self, from: usize, to: usize, bytes: u64, now: Micros) -> Option<Micros>;
}

/// Links that deliver everything after the same delay.
pub struct Fixed(pub Micros);

impl Links for Fixed {
    fn send(&mut self, _from: usize, _to: usize, _bytes: u64, now: Micros) -> Option<Micros> {
        Some(now + self.0)
    }
}

/// Who sent a gossip frame: a node of the network, or a peer outside it (a test's attacker).
#[derive(Clone, Copy, Debug)]
pub enum Origin {
    Node(usize),
    Outside(NodeId),
}

/// What travels in virtual time: network events, and the host's own (`World`).
pub enum Wire<X> {
    /// An event for node `node`'s engine.
    Engine { node: usize, ev: Event },
    /// A gossip frame reaches `node`.
    Gossip {
        node: usize,
        from: Origin,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
    },
    /// A blob request reaches its server.
    FetchReq {
        server: usize,
        client: usize,
        blob: ContentId,
    },
    /// A checkpoint request (manifest or chunk) reaches its server.
    CkptReq {
        server: usize,
        client: usize,
        req: Request,
    },
    /// The host's own event, handed back by [`Net::next`].
    World(X),
}

/// One node as the network sees it.
pub struct Peer {
    /// None once the node crashed.
    pub engine: Option<Engine>,
    pub id: NodeId,
    pub alive: bool,
    /// The peers it exchanges gossip with (links are symmetric).
    pub mesh: BTreeSet<usize>,
    /// Content ids of the gossip frames it has seen (gossipsub's duplicate filter).
    pub seen: HashSet<ContentId>,
    /// The last instant a Timer was queued for (from [`Engine::poll_timeout`]).
    timer: Option<u64>,
}

/// A frame waiting for its engine's verdict: (node, sender, content id, bytes).
type Pending = (usize, Origin, ContentId, Arc<Vec<u8>>);

/// What the network leaves to the world around the engines. Every method but `act` has a
/// default that does what an honest node does.
pub trait Host<X, L: Links>: Sized {
    /// An action the network does not carry (training, applying, reports, penalties, bans,
    /// spot checks, chunk frames via [`Net::respond`], loading checkpoints).
    fn act(&mut self, net: &mut Net<X, L>, node: usize, a: Action, now: Micros);

    /// `node`'s engine is about to handle `ev`.
    fn event(&mut self, _node: usize, _ev: &Event, _now: Micros) {}

    /// `node`'s engine asked for `a`, before it is carried out or handed to `act`.
    fn sees(&mut self, _net: &Net<X, L>, _node: usize, _a: &Action, _now: Micros) {}

    /// Whether `ev`, from `from` to `to` and arriving at `at`, is lost (a test's drop rule).
    fn drops(&mut self, _at: Micros, _from: usize, _to: usize, _ev: &Event) -> bool {
        false
    }

    /// The fetch response `server` sends for `blob` (None: "not here").
    fn serve(&mut self, net: &Net<X, L>, server: usize, blob: &ContentId) -> Option<Vec<u8>> {
        net.peers[server]
            .engine
            .as_ref()
            .and_then(|e| e.serve_update(blob))
    }

    /// The bytes a fetch response `frame` costs on the link.
    fn blob_bytes(&self, frame: &[u8]) -> u64 {
        frame.len() as u64
    }

    /// A fetch from `peer`, which is outside the network: None if it never answers, else when
    /// its answer arrives and what it is (None: a failure).
    fn fetch_outside(
        &mut self,
        net: &Net<X, L>,
        _peer: NodeId,
        _blob: &ContentId,
        now: Micros,
    ) -> Option<(Micros, Option<Vec<u8>>)> {
        Some((now + net.timeout, None))
    }

    /// `server` is about to answer a manifest request: it snapshots its parameters and gives
    /// its engine their manifest (`Event::Snapshot`, through [`Net::deliver`]).
    fn snapshot(&mut self, _net: &mut Net<X, L>, _server: usize, _now: Micros) {}

    /// `server` answers `req` with `bytes` (a lying server alters them): the bytes charged on
    /// the link.
    fn respond(
        &mut self,
        _net: &Net<X, L>,
        _server: usize,
        _req: &Request,
        bytes: &mut Vec<u8>,
    ) -> u64 {
        bytes.len() as u64
    }
}

/// The network: the event queue, the nodes' engines and the links between them.
pub struct Net<X, L> {
    pub q: EventQueue<Wire<X>>,
    pub peers: Vec<Peer>,
    pub index: HashMap<NodeId, usize>,
    pub links: L,
    /// How long a request to a dead, unknown or cut-off peer takes to fail.
    pub timeout: Micros,
    /// The size of a fetch or checkpoint request on the link.
    pub request_bytes: u64,
    /// Whether nodes forward the gossip their engines accept (gossipsub does; the protocol's
    /// tests turn it off to control exactly who hears what).
    pub relay: bool,
    /// Events handled so far.
    pub events: u64,
    pending: HashMap<u64, Pending>,
    next_tag: u64,
    /// Inbound checkpoint requests being served: token → (server, client, request).
    requests: HashMap<u64, (usize, usize, Request)>,
    next_token: u64,
}

impl<X, L: Links> Net<X, L> {
    /// An empty network whose clock starts at `start`.
    pub fn new(start: Micros, links: L, timeout: Micros, request_bytes: u64) -> Self {
        Net {
            q: EventQueue::new(start),
            peers: Vec::new(),
            index: HashMap::new(),
            links,
            timeout,
            request_bytes,
            relay: true,
            events: 0,
            pending: HashMap::new(),
            next_tag: 1,
            requests: HashMap::new(),
            next_token: 1,
        }
    }

    pub fn now(&self) -> Micros {
        self.q.now()
    }

    /// Node `i`'s engine (panics after a crash: tests ask only live nodes).
    pub fn engine(&self, i: usize) -> &Engine {
        self.peers[i]
            .engine
            .as_ref()
            .expect("a live node has an engine")
    }

    /// Put a node process with `engine` at index `i`: a new node at the end, or a restarted
    /// one in place (it keeps its mesh; everything else starts afresh). Its engine wakes now.
    pub fn place(&mut self, i: usize, engine: Engine) {
        let id = engine.node_id();
        let peer = Peer {
            engine: Some(engine),
            id,
            alive: true,
            mesh: BTreeSet::new(),
            seen: HashSet::new(),
            timer: None,
        };
        if i < self.peers.len() {
            let old = std::mem::replace(&mut self.peers[i], peer);
            self.index.remove(&old.id);
            self.peers[i].mesh = old.mesh;
        } else {
            self.peers.push(peer);
        }
        self.index.insert(id, i);
    }

    /// Node `i` crashes: its engine is gone and nothing reaches it.
    pub fn crash(&mut self, i: usize) {
        self.peers[i].alive = false;
        self.peers[i].engine = None;
    }

    /// Link `i` and `j` in both directions (in the mesh only: [`Net::connect`] tells engines).
    pub fn link(&mut self, i: usize, j: usize) {
        self.peers[i].mesh.insert(j);
        self.peers[j].mesh.insert(i);
    }

    /// Node `i` and each live mesh peer hear of each other now.
    pub fn connect(&mut self, i: usize) {
        let now = self.q.now();
        let peers: Vec<usize> = self.peers[i].mesh.iter().copied().collect();
        for j in peers {
            if self.peers[j].alive {
                let (pi, pj) = (self.peers[i].id, self.peers[j].id);
                self.push_event(now, i, Event::PeerConnected { peer: pj });
                self.push_event(now, j, Event::PeerConnected { peer: pi });
            }
        }
    }

    /// Queue `ev` for node `to`'s engine at `at`.
    pub fn push_event(&mut self, at: Micros, to: usize, ev: Event) {
        self.q.push(at, Wire::Engine { node: to, ev });
    }

    /// A gossip frame from a peer outside the network reaches node `to` at `at`, even if it
    /// saw the same frame before.
    pub fn inject(&mut self, at: Micros, to: usize, from: NodeId, bytes: Vec<u8>) {
        let id = ContentId::of(&bytes);
        let (from, bytes) = (Origin::Outside(from), Arc::new(bytes));
        self.q.push(
            at,
            Wire::Gossip {
                node: to,
                from,
                id,
                bytes,
            },
        );
    }

    /// Handle events due by `end` until the host's own next one, which is handed back.
    pub fn next<H: Host<X, L>>(&mut self, end: Micros, host: &mut H) -> Option<(Micros, X)> {
        while let Some((now, w)) = self.q.pop_until(end) {
            self.events += 1;
            match w {
                Wire::World(x) => return Some((now, x)),
                Wire::Engine { node, ev } => self.deliver(node, ev, now, host),
                Wire::Gossip {
                    node,
                    from,
                    id,
                    bytes,
                } => self.receive(node, from, id, bytes, now, host),
                Wire::FetchReq {
                    server,
                    client,
                    blob,
                } => self.serve(server, client, blob, now, host),
                Wire::CkptReq {
                    server,
                    client,
                    req,
                } => self.serve_checkpoint(server, client, req, now, host),
            }
        }
        None
    }

    /// Node `i`'s engine handles `ev`: the network carries what it asks for, the host does the
    /// rest, and one Timer is queued per new instant the engine asks to wake at (stale ones
    /// fire harmlessly).
    pub fn deliver<H: Host<X, L>>(&mut self, i: usize, ev: Event, now: Micros, host: &mut H) {
        if !self.peers[i].alive {
            return;
        }
        host.event(i, &ev, now);
        let Some(engine) = self.peers[i].engine.as_mut() else {
            return;
        };
        for a in engine.handle(ev, now / 1000) {
            host.sees(self, i, &a, now);
            if let Some(a) = self.carry(i, a, now, host) {
                host.act(self, i, a, now);
            }
        }
        let next = self.peers[i].engine.as_ref().and_then(Engine::poll_timeout);
        if let Some(at) = next.filter(|&at| self.peers[i].timer != Some(at)) {
            self.peers[i].timer = Some(at);
            self.push_event(at * 1000, i, Event::Timer);
        }
    }

    /// Carry out a network action of node `i`; any other action is handed back.
    fn carry<H: Host<X, L>>(
        &mut self,
        i: usize,
        a: Action,
        now: Micros,
        host: &mut H,
    ) -> Option<Action> {
        match a {
            Action::Publish { bytes } => {
                let id = ContentId::of(&bytes);
                self.peers[i].seen.insert(id);
                self.gossip(i, id, Arc::new(bytes), None, now);
            }
            Action::Send { peer, bytes } => self.send(i, peer, bytes, now, host),
            Action::Verdict { tag, verdict } => self.verdict(tag, verdict, now),
            Action::Fetch { peer, blob } => self.fetch(i, peer, blob, now, host),
            Action::Request { peer, req } => self.request(i, peer, req, now),
            Action::Respond { token, bytes } => self.respond(i, token, bytes, now, host),
            a => return Some(a),
        }
        None
    }

    /// Queue `ev` from `from` for `to` at `at`, unless the host's drop rule loses it.
    fn arrive<H: Host<X, L>>(
        &mut self,
        host: &mut H,
        from: usize,
        to: usize,
        at: Micros,
        ev: Event,
    ) {
        if !host.drops(at, from, to, &ev) {
            self.push_event(at, to, ev);
        }
    }

    /// Node `i` sends a gossip frame to its mesh peers but `except`.
    pub fn gossip(
        &mut self,
        i: usize,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
        except: Option<usize>,
        now: Micros,
    ) {
        let peers: Vec<usize> = self.peers[i]
            .mesh
            .iter()
            .copied()
            .filter(|&j| Some(j) != except)
            .collect();
        for j in peers {
            self.gossip_to(i, j, id, bytes.clone(), now);
        }
    }

    /// Node `i` sends a gossip frame to `j` alone (an attacker's frames differ per peer).
    pub fn gossip_to(
        &mut self,
        i: usize,
        j: usize,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
        now: Micros,
    ) {
        if let Some(at) = self.links.send(i, j, bytes.len() as u64, now) {
            let from = Origin::Node(i);
            self.q.push(
                at,
                Wire::Gossip {
                    node: j,
                    from,
                    id,
                    bytes,
                },
            );
        }
    }

    /// A gossip frame reaches `node`: the transport's filters, then its engine, with a tag.
    fn receive<H: Host<X, L>>(
        &mut self,
        node: usize,
        from: Origin,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
        now: Micros,
        host: &mut H,
    ) {
        let from_id = match from {
            Origin::Node(j) => self.peers[j].id,
            Origin::Outside(id) => id,
        };
        let p = &self.peers[node];
        let banned = p.engine.as_ref().is_some_and(|e| e.is_banned(&from_id));
        // Injected frames skip the duplicate filter: a test mounts what many relays would
        // let through, and the engine's own rules must hold against it.
        let dup = matches!(from, Origin::Node(_)) && p.seen.contains(&id);
        if !p.alive || banned || dup {
            return;
        }
        let tag = self.next_tag;
        let ev = Event::Message {
            from: from_id,
            tag: Some(tag),
            bytes: bytes.to_vec(),
        };
        if let Origin::Node(j) = from {
            if host.drops(now, j, node, &ev) {
                return;
            }
        }
        self.peers[node].seen.insert(id);
        self.next_tag += 1;
        self.pending.insert(tag, (node, from, id, bytes));
        self.deliver(node, ev, now, host);
    }

    /// A direct message (a Hello, an upload to a first hop) over the link.
    fn send<H: Host<X, L>>(
        &mut self,
        i: usize,
        peer: NodeId,
        bytes: Vec<u8>,
        now: Micros,
        host: &mut H,
    ) {
        if let Some(&j) = self.index.get(&peer) {
            if let Some(at) = self.links.send(i, j, bytes.len() as u64, now) {
                let from = self.peers[i].id;
                let ev = Event::Message {
                    from,
                    tag: None,
                    bytes,
                };
                self.arrive(host, i, j, at, ev);
            }
        }
    }

    /// Forward a validated gossip frame (gossipsub forwards only on `Accept`).
    fn verdict(&mut self, tag: u64, verdict: Verdict, now: Micros) {
        if let Some((node, from, id, bytes)) = self.pending.remove(&tag) {
            if self.relay && verdict == Verdict::Accept && self.peers[node].alive {
                let except = match from {
                    Origin::Node(j) => Some(j),
                    Origin::Outside(_) => None,
                };
                self.gossip(node, id, bytes, except, now);
            }
        }
    }

    /// A blob request to `peer`; no route or a lost request fails after the timeout.
    fn fetch<H: Host<X, L>>(
        &mut self,
        i: usize,
        peer: NodeId,
        blob: ContentId,
        now: Micros,
        host: &mut H,
    ) {
        let fail = Event::FetchFailed { from: peer, blob };
        let Some(j) = self.index.get(&peer).copied() else {
            match host.fetch_outside(self, peer, &blob, now) {
                Some((at, Some(bytes))) => self.push_event(
                    at,
                    i,
                    Event::Fetched {
                        from: peer,
                        blob,
                        bytes,
                    },
                ),
                Some((at, None)) => self.push_event(at, i, fail),
                None => {}
            }
            return;
        };
        match self.links.send(i, j, self.request_bytes, now) {
            Some(at) => self.q.push(
                at,
                Wire::FetchReq {
                    server: j,
                    client: i,
                    blob,
                },
            ),
            None => self.push_event(now + self.timeout, i, fail),
        }
    }

    /// A blob request reaches `server`: its answer (or "not here") travels back.
    fn serve<H: Host<X, L>>(
        &mut self,
        server: usize,
        client: usize,
        blob: ContentId,
        now: Micros,
        host: &mut H,
    ) {
        let from = self.peers[server].id;
        let fail = Event::FetchFailed { from, blob };
        if !self.peers[server].alive {
            return self.push_event(now + self.timeout, client, fail);
        }
        match host.serve(self, server, &blob) {
            Some(frame) => match self
                .links
                .send(server, client, host.blob_bytes(&frame), now)
            {
                Some(at) => {
                    let ev = Event::Fetched {
                        from,
                        blob,
                        bytes: frame,
                    };
                    self.arrive(host, server, client, at, ev);
                }
                None => self.push_event(now + self.timeout, client, fail),
            },
            None => match self.links.send(server, client, 64, now) {
                Some(at) => self.push_event(at, client, fail),
                None => self.push_event(now + self.timeout, client, fail),
            },
        }
    }

    /// A checkpoint request (manifest or chunk) to `peer`.
    fn request(&mut self, i: usize, peer: NodeId, req: Request, now: Micros) {
        let j = self.index.get(&peer).copied();
        match j.map(|j| (j, self.links.send(i, j, self.request_bytes, now))) {
            Some((j, Some(at))) => self.q.push(
                at,
                Wire::CkptReq {
                    server: j,
                    client: i,
                    req,
                },
            ),
            _ => self.push_event(now + self.timeout, i, Event::RequestFailed { peer, req }),
        }
    }

    /// A checkpoint request reaches `server`: its engine decides (`Respond`, `ServeChunk`).
    fn serve_checkpoint<H: Host<X, L>>(
        &mut self,
        server: usize,
        client: usize,
        req: Request,
        now: Micros,
        host: &mut H,
    ) {
        let peer = self.peers[server].id;
        if !self.peers[server].alive || self.peers[server].engine.is_none() {
            let ev = Event::RequestFailed { peer, req };
            return self.push_event(now + self.timeout, client, ev);
        }
        if let Request::Manifest { .. } = req {
            host.snapshot(self, server, now);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.requests.insert(token, (server, client, req.clone()));
        let from = self.peers[client].id;
        let ev = Event::Requested {
            peer: from,
            token,
            req,
        };
        if !host.drops(now, client, server, &ev) {
            self.deliver(server, ev, now, host);
        }
    }

    /// `server` answers checkpoint request `token` with `bytes` (empty: "not here").
    pub fn respond<H: Host<X, L>>(
        &mut self,
        server: usize,
        token: u64,
        mut bytes: Vec<u8>,
        now: Micros,
        host: &mut H,
    ) {
        let Some((_, client, req)) = self.requests.remove(&token) else {
            return;
        };
        let peer = self.peers[server].id;
        let charged = host.respond(self, server, &req, &mut bytes);
        match self.links.send(server, client, charged.max(64), now) {
            Some(at) => self.arrive(
                host,
                server,
                client,
                at,
                Event::Response { peer, req, bytes },
            ),
            None => self.push_event(
                now + self.timeout,
                client,
                Event::RequestFailed { peer, req },
            ),
        }
    }
}
