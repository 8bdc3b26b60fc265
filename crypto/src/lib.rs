//! Node identities, domain-separated signatures and content ids.
//!
//! * A node is an ed25519 keypair; its [`NodeId`] is the 32-byte public key, and its libp2p
//!   PeerId is derived from that key, so the transport's authenticated peer and the signer of
//!   protocol messages are one and the same.
//! * A signature never covers raw message bytes directly: it covers a preimage that names the
//!   message kind and version ([`Domain`]) and the blake3 digest of the exact bytes, so a
//!   signature made for one kind of message can never be replayed as another.
//! * Verification is strict (`verify_strict`): non-canonical signatures and small-order keys are
//!   refused, so a signature is not malleable and "two different signed messages" really means
//!   the key holder signed twice (the basis of equivocation proofs).
//! * Content ids are blake3 of the exact bytes sent.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// Why a key, a signature or an identifier was refused.
#[derive(Debug, Error)]
pub enum CryptoError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}: already exists, refusing to overwrite a key file")]
    Exists(PathBuf),
    #[error("{path}: not a swarm key file: {reason}")]
    BadKeyFile { path: PathBuf, reason: &'static str },
    #[error("{path}: key file is readable by others (mode {mode:o}); chmod 600 it")]
    InsecurePermissions { path: PathBuf, mode: u32 },
    #[error("no OS randomness: {0}")]
    Random(#[from] getrandom::Error),
    #[error("public key is not a valid ed25519 point")]
    InvalidPublicKey,
    #[error("public key has small order")]
    WeakPublicKey,
    #[error("signature does not verify")]
    BadSignature,
    #[error("not an ed25519 libp2p peer id: {0}")]
    BadPeerId(&'static str),
    #[error("bad hex: {0}")]
    BadHex(&'static str),
}

// ---------------------------------------------------------------------------------------------
// hex and base58btc (both tiny; written here to keep the dependency surface small)

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// Parse hex (either case; surrounding whitespace ignored).
pub fn from_hex(s: &str) -> Result<Vec<u8>, CryptoError> {
    let s = s.trim().as_bytes();
    if !s.len().is_multiple_of(2) {
        return Err(CryptoError::BadHex("odd length"));
    }
    let nib = |c: u8| -> Result<u8, CryptoError> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(CryptoError::BadHex("non-hex character")),
        }
    };
    s.chunks(2)
        .map(|p| Ok(nib(p[0])? << 4 | nib(p[1])?))
        .collect()
}

const B58: &[u8; 58] = b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";

/// base58btc (the Bitcoin alphabet), as used for libp2p PeerIds.
pub fn base58_encode(bytes: &[u8]) -> String {
    let zeros = bytes.iter().take_while(|&&b| b == 0).count();
    // Base-58 digits, least significant first; a plain long division is fine for ids this short.
    let mut digits: Vec<u8> = Vec::with_capacity(bytes.len() * 138 / 100 + 1);
    for &b in &bytes[zeros..] {
        let mut carry = b as u32;
        for d in digits.iter_mut() {
            carry += (*d as u32) << 8;
            *d = (carry % 58) as u8;
            carry /= 58;
        }
        while carry > 0 {
            digits.push((carry % 58) as u8);
            carry /= 58;
        }
    }
    let mut s = String::with_capacity(zeros + digits.len());
    s.extend(std::iter::repeat_n('1', zeros));
    s.extend(digits.iter().rev().map(|&d| B58[d as usize] as char));
    s
}

/// Inverse of [`base58_encode`]; `None` on a character outside the alphabet.
pub fn base58_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    let ones = s.iter().take_while(|&&c| c == b'1').count();
    let mut bytes: Vec<u8> = Vec::with_capacity(s.len());
    for &c in &s[ones..] {
        let mut carry = B58.iter().position(|&a| a == c)? as u32;
        for b in bytes.iter_mut() {
            carry += (*b as u32) * 58;
            *b = carry as u8;
            carry >>= 8;
        }
        while carry > 0 {
            bytes.push(carry as u8);
            carry >>= 8;
        }
    }
    let mut out = vec![0u8; ones];
    out.extend(bytes.iter().rev());
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// 32-byte hashes

fn ser_bytes<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(b)
}

struct FixedBytes<const N: usize>;

impl<'de, const N: usize> serde::de::Visitor<'de> for FixedBytes<N> {
    type Value = [u8; N];
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a byte string of length {N}")
    }
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<[u8; N], E> {
        v.try_into().map_err(|_| E::invalid_length(v.len(), &self))
    }
}

fn de_fixed<'de, D: Deserializer<'de>, const N: usize>(d: D) -> Result<[u8; N], D::Error> {
    d.deserialize_bytes(FixedBytes::<N>)
}

macro_rules! hash32 {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }
            pub fn to_hex(&self) -> String {
                to_hex(&self.0)
            }
            pub fn from_hex(s: &str) -> Result<Self, CryptoError> {
                let v = from_hex(s)?;
                Ok($name(v.try_into().map_err(|_| CryptoError::BadHex("expected 32 bytes"))?))
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }
        impl fmt::Debug for $name {
            // Eight bytes are plenty to tell ids apart in logs and test failures.
            fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "{}({}…)", stringify!($name), &self.to_hex()[..16])
            }
        }
        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                ser_bytes(&self.0, s)
            }
        }
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                de_fixed(d).map($name)
            }
        }
    };
}

hash32!(
    /// blake3 of the exact bytes of a blob or message: what peers ask each other for.
    ContentId
);
hash32!(
    /// A 32-byte blake3 digest of something other than a sent byte string (parameters, configs).
    Digest
);

impl ContentId {
    pub fn of(bytes: &[u8]) -> ContentId {
        ContentId(*blake3::hash(bytes).as_bytes())
    }

    /// blake3 in key-derivation mode for `context` (a fixed, globally unique string) over
    /// `parts` in order: an id that names bytes *together with* what they belong to, so that
    /// the same bytes under another owner get another id.
    pub fn derived(context: &str, parts: &[&[u8]]) -> ContentId {
        let mut h = blake3::Hasher::new_derive_key(context);
        for p in parts {
            h.update(p);
        }
        ContentId(*h.finalize().as_bytes())
    }
}

impl Digest {
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }
}

// ---------------------------------------------------------------------------------------------
// identities and signatures

/// The libp2p protobuf `PublicKey { KeyType Type = 1 (Ed25519 = 1); bytes Data = 2 (32 bytes) }`
/// wrapped in an identity multihash (code 0x00, length 0x24 = 36), ahead of the raw key.
const PEER_ID_PREFIX: [u8; 6] = [0x00, 0x24, 0x08, 0x01, 0x12, 0x20];

/// A node's public identity: its ed25519 public key, compressed (32 bytes).
///
/// A `NodeId` read off the wire is only bytes until [`NodeId::verifying_key`] (done by every
/// signature check) accepted it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub [u8; 32]);

impl NodeId {
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as a point, refusing invalid encodings and small-order (weak) keys.
    pub fn verifying_key(&self) -> Result<VerifyingKey, CryptoError> {
        let vk = VerifyingKey::from_bytes(&self.0).map_err(|_| CryptoError::InvalidPublicKey)?;
        if vk.is_weak() {
            return Err(CryptoError::WeakPublicKey);
        }
        Ok(vk)
    }

    /// The libp2p PeerId bytes: identity multihash of the protobuf-encoded public key.
    pub fn peer_id_bytes(&self) -> [u8; 38] {
        let mut b = [0u8; 38];
        b[..6].copy_from_slice(&PEER_ID_PREFIX);
        b[6..].copy_from_slice(&self.0);
        b
    }

    /// The PeerId libp2p derives from this key, base58btc ("12D3KooW…").
    pub fn peer_id_string(&self) -> String {
        base58_encode(&self.peer_id_bytes())
    }

    /// Parse a base58btc PeerId of an ed25519 key (other key types are not swarm nodes).
    pub fn from_peer_id_str(s: &str) -> Result<NodeId, CryptoError> {
        let b = base58_decode(s).ok_or(CryptoError::BadPeerId("not base58btc"))?;
        NodeId::from_peer_id_bytes(&b)
    }

    pub fn from_peer_id_bytes(b: &[u8]) -> Result<NodeId, CryptoError> {
        if b.len() != 38 || b[..6] != PEER_ID_PREFIX {
            return Err(CryptoError::BadPeerId(
                "not an identity-multihashed ed25519 key",
            ));
        }
        Ok(NodeId(b[6..].try_into().expect("length checked")))
    }

    /// Strictly verify `sig` over `bytes` in `domain`.
    pub fn verify(&self, domain: Domain, bytes: &[u8], sig: &Signature) -> Result<(), CryptoError> {
        let vk = self.verifying_key()?;
        let sig = ed25519_dalek::Signature::from_bytes(&sig.0);
        vk.verify_strict(&domain.preimage(bytes), &sig)
            .map_err(|_| CryptoError::BadSignature)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.peer_id_string())
    }
}
impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "NodeId({}…)", &to_hex(&self.0)[..16])
    }
}
impl Serialize for NodeId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ser_bytes(&self.0, s)
    }
}
impl<'de> Deserialize<'de> for NodeId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_fixed(d).map(NodeId)
    }
}

/// An ed25519 signature (64 bytes, R ‖ s).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Signature(pub [u8; 64]);

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Signature({}…)", &to_hex(&self.0)[..16])
    }
}
impl Serialize for Signature {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ser_bytes(&self.0, s)
    }
}
impl<'de> Deserialize<'de> for Signature {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_fixed(d).map(Signature)
    }
}

/// The kind and version of a signed message, e.g. `swarm/update-header/v1`.
///
/// The signed preimage is `"swarm-sig-v1" ‖ 0x00 ‖ len(domain) as one byte ‖ domain ‖
/// blake3(bytes)`: fixed-length after the domain, so no two (domain, bytes) pairs share one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Domain(&'static str);

const SIG_PREFIX: &[u8] = b"swarm-sig-v1\0";

impl Domain {
    /// Panics (at start-up, on a programming error) if the name is empty or over 255 bytes.
    pub const fn new(name: &'static str) -> Domain {
        assert!(!name.is_empty() && name.len() <= 255);
        Domain(name)
    }

    pub fn name(&self) -> &'static str {
        self.0
    }

    /// The exact bytes the ed25519 signature covers.
    pub fn preimage(&self, bytes: &[u8]) -> Vec<u8> {
        let mut m = Vec::with_capacity(SIG_PREFIX.len() + 1 + self.0.len() + 32);
        m.extend_from_slice(SIG_PREFIX);
        m.push(self.0.len() as u8);
        m.extend_from_slice(self.0.as_bytes());
        m.extend_from_slice(blake3::hash(bytes).as_bytes());
        m
    }
}

/// A node's secret key.
pub struct Identity {
    key: SigningKey,
}

impl fmt::Debug for Identity {
    // Never print the secret.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Identity({:?})", self.node_id())
    }
}

const KEY_FILE_TAG: &str = "swarm-ed25519-secret-v1";
const KEY_FILE_MAX: u64 = 1024;

impl Identity {
    /// A fresh key from the OS's randomness.
    pub fn generate() -> Result<Identity, CryptoError> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed)?;
        Ok(Identity::from_seed(seed))
    }

    /// A key from a 32-byte seed (the ed25519 secret key). Tests and golden vectors use fixed
    /// seeds; a real node uses [`Identity::generate`].
    pub fn from_seed(seed: [u8; 32]) -> Identity {
        Identity {
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// The 32-byte secret seed (to hand to libp2p's `Keypair::ed25519_from_bytes`).
    pub fn seed(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    pub fn node_id(&self) -> NodeId {
        NodeId(self.key.verifying_key().to_bytes())
    }

    pub fn sign(&self, domain: Domain, bytes: &[u8]) -> Signature {
        Signature(self.key.sign(&domain.preimage(bytes)).to_bytes())
    }

    /// Write the key to a new file, mode 0600, refusing to overwrite anything already there.
    ///
    /// The file is created with `create_new` (atomic: no window where another file could be
    /// clobbered) and its mode is set at creation, so the secret is never readable by others.
    pub fn write_new(&self, path: &Path) -> Result<(), CryptoError> {
        let io = |source| CryptoError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts.open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                CryptoError::Exists(path.to_path_buf())
            } else {
                io(e)
            }
        })?;
        let text = format!("{KEY_FILE_TAG} {}\n", to_hex(&self.seed()));
        f.write_all(text.as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        Ok(())
    }

    /// Read a key written by [`Identity::write_new`]. Refuses a file others can read.
    pub fn load(path: &Path) -> Result<Identity, CryptoError> {
        let io = |source| CryptoError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bad = |reason| CryptoError::BadKeyFile {
            path: path.to_path_buf(),
            reason,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = f.metadata().map_err(io)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(CryptoError::InsecurePermissions {
                    path: path.to_path_buf(),
                    mode,
                });
            }
        }
        let mut text = String::new();
        f.take(KEY_FILE_MAX + 1)
            .read_to_string(&mut text)
            .map_err(|_| bad("not UTF-8 text"))?;
        if text.len() as u64 > KEY_FILE_MAX {
            return Err(bad("too long"));
        }
        let mut parts = text.split_ascii_whitespace();
        if parts.next() != Some(KEY_FILE_TAG) {
            return Err(bad("missing swarm-ed25519-secret-v1 tag"));
        }
        let hex = parts.next().ok_or(bad("missing key"))?;
        if parts.next().is_some() {
            return Err(bad("trailing data"));
        }
        let seed: [u8; 32] = from_hex(hex)
            .map_err(|_| bad("key is not hex"))?
            .try_into()
            .map_err(|_| bad("key is not 32 bytes"))?;
        Ok(Identity::from_seed(seed))
    }
}

/// Identity proof of work: a Sybil must pay for each fresh key it brings into a run.
///
/// `blake3("swarm-pow-v1" ‖ run ‖ node ‖ u64le(nonce))` must start with `bits` zero bits. The
/// puzzle binds the key and the run, so work done for one identity or one run buys nothing in
/// another; checking costs one hash, solving `2^bits` on average.
pub mod pow {
    use super::NodeId;

    fn hash(run: &[u8; 32], node: &NodeId, nonce: u64) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"swarm-pow-v1");
        h.update(run);
        h.update(&node.0);
        h.update(&nonce.to_le_bytes());
        *h.finalize().as_bytes()
    }

    /// Leading zero bits of a hash.
    pub fn zero_bits(h: &[u8; 32]) -> u32 {
        let mut n = 0;
        for b in h {
            if *b == 0 {
                n += 8;
            } else {
                return n + b.leading_zeros();
            }
        }
        n
    }

    /// Whether `nonce` proves `bits` of work for `node` in `run` (always true for 0 bits).
    pub fn check(run: &[u8; 32], node: &NodeId, nonce: u64, bits: u32) -> bool {
        bits == 0 || zero_bits(&hash(run, node, nonce)) >= bits
    }

    /// The first nonce from 0 that proves `bits` of work (expected `2^bits` hashes).
    pub fn solve(run: &[u8; 32], node: &NodeId, bits: u32) -> u64 {
        (0u64..)
            .find(|&n| check(run, node, n, bits))
            .expect("some nonce below 2^64 works")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Domain = Domain::new("swarm/test/v1");

    #[test]
    fn base58_round_trip_and_known_values() {
        assert_eq!(base58_encode(b""), "");
        assert_eq!(base58_encode(&[0, 0, 1]), "112");
        // "hello world" in base58btc (a standard example of the alphabet).
        assert_eq!(base58_encode(b"hello world"), "StV1DL6CwTryKyV");
        for v in [
            vec![],
            vec![0u8],
            vec![0, 0, 255],
            (0..=255u8).collect::<Vec<_>>(),
        ] {
            assert_eq!(base58_decode(&base58_encode(&v)).unwrap(), v);
        }
        assert!(base58_decode("0OIl").is_none());
    }

    #[test]
    fn peer_id_known_vector() {
        // The RFC 8032 test 1 key: secret 9d61b1…7f60, public d75a98…511a.
        let seed: [u8; 32] =
            from_hex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
                .unwrap()
                .try_into()
                .unwrap();
        let id = Identity::from_seed(seed).node_id();
        assert_eq!(
            to_hex(id.as_bytes()),
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
        );
        let pid = id.peer_id_string();
        // Hand derivation: multihash(identity) of protobuf {Type: Ed25519, Data: key}. The literal
        // below was cross-checked with an independent base58 implementation (Python bigint).
        let mut want = vec![0x00, 0x24, 0x08, 0x01, 0x12, 0x20];
        want.extend_from_slice(id.as_bytes());
        assert_eq!(base58_decode(&pid).unwrap(), want);
        assert!(pid.starts_with("12D3KooW"), "{pid}");
        assert_eq!(pid, "12D3KooWQK1wnefoLrcVHbbnf5tLzbopUd3K3bFAoJpA7YJgL5pV");
        assert_eq!(NodeId::from_peer_id_str(&pid).unwrap(), id);
        assert!(
            NodeId::from_peer_id_str("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N").is_err()
        );
    }

    #[test]
    fn sign_verify_domain_separated() {
        let a = Identity::from_seed([1; 32]);
        let sig = a.sign(D, b"msg");
        a.node_id().verify(D, b"msg", &sig).unwrap();
        assert!(matches!(
            a.node_id().verify(D, b"msh", &sig),
            Err(CryptoError::BadSignature)
        ));
        let other = Domain::new("swarm/test/v2");
        assert!(matches!(
            a.node_id().verify(other, b"msg", &sig),
            Err(CryptoError::BadSignature)
        ));
        let b = Identity::from_seed([2; 32]);
        assert!(b.node_id().verify(D, b"msg", &sig).is_err());
    }

    #[test]
    fn weak_and_invalid_keys_refused() {
        // The identity point (y = 1) has order 1: with verify_strict nothing signed by it counts.
        let mut ident = [0u8; 32];
        ident[0] = 1;
        let sig = Signature([0; 64]);
        assert!(matches!(
            NodeId(ident).verify(D, b"", &sig),
            Err(CryptoError::WeakPublicKey)
        ));
        // y = 2 is not on the curve.
        let mut bad = [0u8; 32];
        bad[0] = 2;
        assert!(matches!(
            NodeId(bad).verify(D, b"", &sig),
            Err(CryptoError::InvalidPublicKey)
        ));
    }

    #[test]
    fn malleated_signature_refused() {
        // s + L (the group order) verifies under lax rules but not strict ones.
        let a = Identity::from_seed([3; 32]);
        let sig = a.sign(D, b"x");
        let l: [u8; 32] =
            from_hex("edd3f55c1a631258d69cf7a2def9de1400000000000000000000000000000010")
                .unwrap()
                .try_into()
                .unwrap();
        let mut s = [0u8; 32];
        s.copy_from_slice(&sig.0[32..]);
        let mut carry = 0u16;
        for i in 0..32 {
            let v = s[i] as u16 + l[i] as u16 + carry;
            s[i] = v as u8;
            carry = v >> 8;
        }
        let mut m = sig.0;
        m[32..].copy_from_slice(&s);
        assert!(a.node_id().verify(D, b"x", &Signature(m)).is_err());
    }

    #[test]
    fn key_file_round_trip_mode_and_no_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("node.key");
        let id = Identity::generate().unwrap();
        id.write_new(&p).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        assert_eq!(Identity::load(&p).unwrap().node_id(), id.node_id());
        let before = std::fs::read(&p).unwrap();
        assert!(matches!(
            Identity::from_seed([9; 32]).write_new(&p),
            Err(CryptoError::Exists(_))
        ));
        assert_eq!(std::fs::read(&p).unwrap(), before);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert!(matches!(
                Identity::load(&p),
                Err(CryptoError::InsecurePermissions { .. })
            ));
        }
        let q = dir.path().join("junk.key");
        id.write_new(&q).unwrap();
        std::fs::write(&q, "hello").unwrap();
        assert!(matches!(
            Identity::load(&q),
            Err(CryptoError::BadKeyFile { .. })
        ));
    }

    #[test]
    fn hashes_serialize_as_cbor_bytes() {
        let c = ContentId::of(b"abc");
        let enc = serde_cbor::to_vec(&c).unwrap();
        assert_eq!(enc[0], 0x58);
        assert_eq!(enc[1], 32);
        assert_eq!(serde_cbor::from_slice::<ContentId>(&enc).unwrap(), c);
        assert!(serde_cbor::from_slice::<ContentId>(
            &serde_cbor::to_vec(&serde_bytes_like(&[1, 2])).unwrap()
        )
        .is_err());
        assert_eq!(ContentId::from_hex(&c.to_hex()).unwrap(), c);
    }

    fn serde_bytes_like(b: &[u8]) -> serde_cbor::Value {
        serde_cbor::Value::Bytes(b.to_vec())
    }

    #[test]
    fn pow_binds_key_and_run() {
        let run = [3u8; 32];
        let a = Identity::from_seed([1; 32]).node_id();
        let n = pow::solve(&run, &a, 10);
        assert!(pow::check(&run, &a, n, 10));
        assert!(pow::check(&run, &a, 12345, 0));
        // The nonce proves nothing for other keys or another run (each passes with 2^-10).
        let other_keys = (0..1000u32)
            .filter(|i| {
                let mut s = [9u8; 32];
                s[..4].copy_from_slice(&i.to_le_bytes());
                pow::check(&run, &Identity::from_seed(s).node_id(), n, 10)
            })
            .count();
        assert!(other_keys < 10, "{other_keys}");
        let other_runs = (0..1000u32)
            .filter(|i| {
                let mut r = [7u8; 32];
                r[..4].copy_from_slice(&i.to_le_bytes());
                pow::check(&r, &a, n, 10)
            })
            .count();
        assert!(other_runs < 10, "{other_runs}");
    }
}
