//! `--status`: one JSON line per applied step, written by `swarm run` ([`StatusSink`]), read
//! back by `swarm demo` ([`read`]) and shown by `--tui`: one type, [`StatusLine`], for all.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// One line of `--status`, as `swarm run` writes it and `swarm demo` reads it back.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
pub struct StatusLine {
    #[serde(default)]
    pub node: String,
    pub step: u64,
    pub version: u64,
    pub loss: Option<f64>,
    pub peers: usize,
    pub included: usize,
    pub update_bytes: u64,
    /// Bytes sent / received during this step (libp2p bandwidth counters).
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub train_ms: u64,
    pub apply_ms: u64,
    pub digest: String,
    pub t_ms: u64,
    pub rejected: u64,
    pub fetches: u64,
    /// Tokens this node's own update for the step claimed (0: it sent none).
    pub tokens: u64,
    /// Tokens of all the updates applied in the step, as their headers state them.
    pub included_tokens: u64,
    /// When this node handed its own update for the step to the network (unix ms).
    #[serde(default)]
    pub published_ms: Option<u64>,
    /// When each peer's update for the step checked out here (peer id → unix ms); only those
    /// that arrived before this line was written (at the step's apply).
    #[serde(default)]
    pub arrivals: BTreeMap<String, u64>,
    /// Held-out loss after applying the step (every `--eval-every` steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Penalties and bans this node has handed out so far (cumulative).
    #[serde(default)]
    pub penalties: u64,
    #[serde(default)]
    pub bans: u64,
}

/// The status lines of a file written by `swarm run --status`; none if it cannot be opened.
pub fn read(p: &Path) -> Vec<StatusLine> {
    match std::fs::File::open(p) {
        Ok(f) => read_lines(std::io::BufReader::new(f)),
        Err(_) => Vec::new(),
    }
}

/// Every line that parses. A line being written may be torn: what does not parse is skipped.
pub fn read_lines(r: impl BufRead) -> Vec<StatusLine> {
    r.lines()
        .map_while(|l| l.ok())
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect()
}

/// `--status`: one JSON line per applied step. A failed write (a full disk, a removed file) is
/// logged, once until a write succeeds again, and the node goes on: the file is a report, and
/// losing a line of it must not stop training.
pub struct StatusSink<W: Write> {
    out: W,
    failed: bool,
    lost: u64,
}

impl<W: Write> StatusSink<W> {
    pub fn new(out: W) -> Self {
        StatusSink {
            out,
            failed: false,
            lost: 0,
        }
    }

    pub fn line(&mut self, json: &str) {
        match writeln!(self.out, "{json}").and_then(|()| self.out.flush()) {
            Ok(()) => {
                if self.failed {
                    tracing::info!(lost = self.lost, "writing --status works again");
                }
                self.failed = false;
            }
            Err(e) => {
                if !self.failed {
                    tracing::error!("writing --status failed (going on without it): {e}");
                }
                self.failed = true;
                self.lost += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{read_lines, StatusLine, StatusSink};

    /// A writer that fails while `full` is set, as a full disk does.
    struct Disk {
        full: bool,
        lines: Vec<u8>,
    }
    impl std::io::Write for Disk {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.full {
                return Err(std::io::Error::other("no space left on device"));
            }
            self.lines.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_status_write_is_counted_and_the_next_one_goes_through() {
        let mut s = StatusSink::new(Disk {
            full: false,
            lines: Vec::new(),
        });
        s.line("1");
        s.out.full = true;
        s.line("2");
        s.line("3");
        assert!(s.failed);
        assert_eq!(s.lost, 2);
        s.out.full = false;
        s.line("4");
        assert!(!s.failed);
        assert_eq!(String::from_utf8(s.out.lines.clone()).unwrap(), "1\n4\n");
    }

    /// The real thing: `/dev/full` refuses every write with ENOSPC.
    #[test]
    fn status_on_a_full_device_does_not_panic_or_stop() {
        let Ok(f) = std::fs::OpenOptions::new().append(true).open("/dev/full") else {
            return; // not on this system
        };
        let mut s = StatusSink::new(f);
        for i in 0..3 {
            s.line(&format!("{{\"step\":{i}}}"));
        }
        assert_eq!(s.lost, 3);
    }

    /// What `swarm run` writes, `swarm demo` reads back the same; a torn last line is skipped.
    #[test]
    fn a_status_line_round_trips_and_a_torn_one_is_skipped() {
        let full = StatusLine {
            node: "trainer-1".into(),
            step: 7,
            version: 8,
            loss: Some(3.25),
            peers: 4,
            included: 3,
            update_bytes: 1 << 20,
            bytes_out: 123,
            bytes_in: 456,
            train_ms: 900,
            apply_ms: 40,
            digest: "ab".repeat(32),
            t_ms: 1_700_000_000_000,
            rejected: 1,
            fetches: 2,
            tokens: 4096,
            included_tokens: 12288,
            published_ms: Some(1_699_999_999_000),
            arrivals: [("12D3KooW".to_string(), 1_699_999_999_500)].into(),
            eval_loss: Some(3.5),
            penalties: 5,
            bans: 1,
        };
        let bare = StatusLine::default();
        let mut file = Vec::new();
        for l in [&full, &bare] {
            let json = serde_json::to_string(l).unwrap();
            assert_eq!(&serde_json::from_str::<StatusLine>(&json).unwrap(), l);
            file.extend_from_slice(json.as_bytes());
            file.push(b'\n');
        }
        let torn = serde_json::to_string(&full).unwrap();
        file.extend_from_slice(&torn.as_bytes()[..torn.len() / 2]);
        assert_eq!(read_lines(&file[..]), vec![full, bare]);
        // Without a held-out loss the key is left out of the line.
        let json = serde_json::to_string(&StatusLine::default()).unwrap();
        assert!(!json.contains("eval_loss"), "{json}");
    }
}
