//! PeerId parsing (base58btc + multihash), as `swarm` does for ids given on the command line.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(id) = crypto::NodeId::from_peer_id_str(s) {
            assert_eq!(crypto::NodeId::from_peer_id_str(&id.peer_id_string()).unwrap(), id);
        }
    }
    let _ = crypto::NodeId::from_peer_id_bytes(data);
});
