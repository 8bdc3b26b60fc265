//! Inbound connections per remote IP address, as a libp2p behaviour that denies a connection
//! when it is established (before any protocol runs on it). `connection_limits` caps
//! connections in all and per peer id, but peer ids are free: one machine with 128 keys could
//! still fill every inbound slot a node has. Outbound connections (the node's own choice:
//! bootstrap peers, discovery) are never counted. Loopback can be exempt, because local
//! swarms (tests, `swarm demo`) run every node on 127.0.0.1.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::multiaddr::Protocol;
use libp2p::core::transport::PortUse;
use libp2p::core::{ConnectedPoint, Endpoint, Multiaddr};
use libp2p::swarm::{
    dummy, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::PeerId;

/// Why a connection was denied.
#[derive(Debug, thiserror::Error)]
#[error("{ip} already has {limit} inbound connections")]
pub struct PerIpExceeded {
    pub ip: IpAddr,
    pub limit: u32,
}

pub struct Behaviour {
    per_ip: u32,
    exempt_loopback: bool,
    /// Established inbound connections and the IP each came from.
    inbound: HashMap<ConnectionId, IpAddr>,
}

impl Behaviour {
    pub fn new(per_ip: u32, exempt_loopback: bool) -> Behaviour {
        Behaviour {
            per_ip,
            exempt_loopback,
            inbound: HashMap::new(),
        }
    }

    /// Inbound connections established from `ip` now.
    pub fn count(&self, ip: IpAddr) -> usize {
        self.inbound.values().filter(|x| **x == ip).count()
    }
}

/// The IP address of a multiaddr (its first `/ip4` or `/ip6` part), if any.
fn ip_of(a: &Multiaddr) -> Option<IpAddr> {
    a.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        let Some(ip) = ip_of(remote) else {
            return Ok(dummy::ConnectionHandler);
        };
        if self.exempt_loopback && ip.is_loopback() {
            return Ok(dummy::ConnectionHandler);
        }
        if self.count(ip) >= self.per_ip as usize {
            return Err(ConnectionDenied::new(PerIpExceeded {
                ip,
                limit: self.per_ip,
            }));
        }
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                if let ConnectedPoint::Listener { send_back_addr, .. } = e.endpoint {
                    if let Some(ip) = ip_of(send_back_addr) {
                        self.inbound.insert(e.connection_id, ip);
                    }
                }
            }
            FromSwarm::ConnectionClosed(e) => {
                self.inbound.remove(&e.connection_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Infallible, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ip_of_an_address() {
        let a: Multiaddr = "/ip4/10.0.0.7/tcp/4001".parse().unwrap();
        assert_eq!(ip_of(&a), Some("10.0.0.7".parse().unwrap()));
        let b: Multiaddr = "/ip6/::1/udp/4001/quic-v1".parse().unwrap();
        assert_eq!(ip_of(&b), Some("::1".parse().unwrap()));
        let c: Multiaddr = "/dns4/example.org/tcp/1".parse().unwrap();
        assert_eq!(ip_of(&c), None);
    }
}
