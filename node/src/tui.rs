//! `swarm run --tui`: a live view of one node in the terminal.
//!
//! The node's event loop never waits on the screen: it hands each applied step (its status
//! line), each offence and each checkpoint event to a bounded queue with `try_send` (a full
//! queue drops the update; the next status line carries the cumulative counters again), and a
//! thread of its own drains the queue, redraws four times a second and reads the keyboard.
//! Logs go to a ring of the last lines shown in the view instead of stderr, which would tear
//! the screen. [`View`] is plain state plus a `draw`, so tests render it into ratatui's
//! `TestBackend` and read the cells.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ratatui::layout::{Constraint, Direction, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Sparkline};
use ratatui::Frame;

use crate::status::StatusLine;

/// Steps kept for the sparklines (a wide terminal shows ~200).
const HISTORY: usize = 240;
/// Log lines kept for the log pane.
const LOG_LINES: usize = 200;
/// Offences kept for the "last offences" list.
const OFFENCES: usize = 4;
/// Updates waiting for the view thread; beyond it they are dropped (never block the node).
const QUEUE: usize = 256;

/// What the node tells the view.
#[derive(Clone, Debug)]
pub enum Update {
    /// A step was applied (the `--status` line of it).
    Status(Box<StatusLine>),
    /// A peer was penalized or banned.
    Offence {
        peer: String,
        reason: String,
        ban: bool,
    },
    /// Where this node's checkpoints stand (saved, downloading, loaded…).
    Checkpoint(String),
    /// Peers of the run connected now.
    Peers(usize),
}

/// The node's end of the queue.
#[derive(Clone)]
pub struct Feed(std::sync::mpsc::SyncSender<Update>);

impl Feed {
    /// Hand `u` to the view if it has room; never waits.
    pub fn send(&self, u: Update) {
        let _ = self.0.try_send(u);
    }
}

/// The last lines of the log (tracing writes here instead of stderr while the view is up).
#[derive(Clone, Default)]
pub struct LogRing(Arc<Mutex<VecDeque<String>>>);

impl LogRing {
    fn push(&self, text: &str) {
        let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for l in text.lines().filter(|l| !l.trim().is_empty()) {
            if q.len() == LOG_LINES {
                q.pop_front();
            }
            q.push_back(l.to_string());
        }
    }

    fn last(&self, n: usize) -> Vec<String> {
        let q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        q.iter().skip(q.len().saturating_sub(n)).cloned().collect()
    }
}

/// One tracing event's text, pushed to the ring when the event is written out.
pub struct RingWriter {
    ring: LogRing,
    buf: Vec<u8>,
}

impl Write for RingWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        self.ring.push(&String::from_utf8_lossy(&self.buf));
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogRing {
    type Writer = RingWriter;
    fn make_writer(&'a self) -> RingWriter {
        RingWriter {
            ring: self.clone(),
            buf: Vec::new(),
        }
    }
}

/// Everything the view shows.
pub struct View {
    /// This node's id and the run it is in.
    pub node: String,
    pub run: String,
    genesis_ms: u64,
    period_ms: u64,
    steps: VecDeque<StatusLine>,
    evals: VecDeque<(u64, f64)>,
    peers: usize,
    offences: VecDeque<(String, String, bool)>,
    checkpoint: String,
    log: LogRing,
}

impl View {
    pub fn new(node: String, run: String, genesis_ms: u64, period_ms: u64, log: LogRing) -> View {
        View {
            node,
            run,
            genesis_ms,
            period_ms: period_ms.max(1),
            steps: VecDeque::new(),
            evals: VecDeque::new(),
            peers: 0,
            offences: VecDeque::new(),
            checkpoint: "none yet".into(),
            log,
        }
    }

    pub fn update(&mut self, u: Update) {
        match u {
            Update::Status(s) => {
                if let Some(e) = s.eval_loss {
                    if self.evals.len() == HISTORY {
                        self.evals.pop_front();
                    }
                    self.evals.push_back((s.step, e));
                }
                self.peers = s.peers;
                if self.steps.len() == HISTORY {
                    self.steps.pop_front();
                }
                self.steps.push_back(*s);
            }
            Update::Offence { peer, reason, ban } => {
                if self.offences.len() == OFFENCES {
                    self.offences.pop_front();
                }
                self.offences.push_back((peer, reason, ban));
            }
            Update::Checkpoint(c) => self.checkpoint = c,
            Update::Peers(n) => self.peers = n,
        }
    }

    /// The step clock at `now_ms`: the step under way and the milliseconds left in it.
    fn clock(&self, now_ms: u64) -> (Option<u64>, u64) {
        if now_ms < self.genesis_ms {
            return (None, self.genesis_ms - now_ms);
        }
        let since = now_ms - self.genesis_ms;
        (
            Some(since / self.period_ms),
            self.period_ms - since % self.period_ms,
        )
    }

    pub fn draw(&self, f: &mut Frame, now_ms: u64) {
        let rows = Layout::default()
            .direction(Direction::Vertical)
            .constraints([
                Constraint::Length(3),
                Constraint::Length(7),
                Constraint::Length(5),
                Constraint::Length(6),
                Constraint::Min(3),
            ])
            .split(f.area());
        self.draw_header(f, rows[0], now_ms);
        self.draw_losses(f, rows[1]);
        self.draw_traffic(f, rows[2]);
        self.draw_defence(f, rows[3]);
        let log = self.log.last(rows[4].height.saturating_sub(2) as usize);
        let log: Vec<Line> = log.into_iter().map(Line::from).collect();
        f.render_widget(
            Paragraph::new(log).block(Block::default().borders(Borders::ALL).title(" log ")),
            rows[4],
        );
    }

    fn draw_header(&self, f: &mut Frame, area: Rect, now_ms: u64) {
        let (step, left) = self.clock(now_ms);
        let clock = match step {
            Some(s) => format!("step {s} under way, {:.1} s left", left as f64 / 1e3),
            None => format!("genesis in {:.1} s", left as f64 / 1e3),
        };
        let applied = self.steps.back().map_or("none".into(), |s| {
            format!("{} (version {})", s.step, s.version)
        });
        let digest = self
            .steps
            .back()
            .map_or(String::new(), |s| s.digest.chars().take(12).collect());
        let bold = Style::default().add_modifier(Modifier::BOLD);
        let line = Line::from(vec![
            Span::styled(clock, bold),
            Span::raw(format!(
                "   last applied {applied}   digest {digest}   peers "
            )),
            Span::styled(self.peers.to_string(), bold),
        ]);
        f.render_widget(
            Paragraph::new(line).block(Block::default().borders(Borders::ALL).title(format!(
                " swarm · {} · {} · q to leave ",
                self.node, self.run
            ))),
            area,
        );
    }

    fn draw_losses(&self, f: &mut Frame, area: Rect) {
        let cols = Layout::default()
            .direction(Direction::Horizontal)
            .constraints([Constraint::Percentage(50), Constraint::Percentage(50)])
            .split(area);
        let train: Vec<f64> = self.steps.iter().filter_map(|s| s.loss).collect();
        let evals: Vec<f64> = self.evals.iter().map(|e| e.1).collect();
        let title = |name: &str, v: &[f64]| match v.last() {
            Some(l) => format!(
                " {name} loss {l:.4} (min {:.4}) ",
                v.iter().cloned().fold(f64::INFINITY, f64::min)
            ),
            None => format!(" {name} loss: none yet "),
        };
        spark_u(
            f,
            cols[0],
            &title("train", &train),
            &inverted(&train),
            Color::Cyan,
        );
        spark_u(
            f,
            cols[1],
            &title("eval", &evals),
            &inverted(&evals),
            Color::Green,
        );
    }

    fn draw_traffic(&self, f: &mut Frame, area: Rect) {
        let cols = Layout::default()
            .direction(Direction::Horizontal)
            .constraints([
                Constraint::Percentage(34),
                Constraint::Percentage(33),
                Constraint::Percentage(33),
            ])
            .split(area);
        let outs: Vec<u64> = self.steps.iter().map(|s| s.bytes_out).collect();
        let ins: Vec<u64> = self.steps.iter().map(|s| s.bytes_in).collect();
        let inc: Vec<u64> = self.steps.iter().map(|s| s.included as u64).collect();
        let last = |v: &[u64]| v.last().copied().unwrap_or(0);
        spark_u(
            f,
            cols[0],
            &format!(" out {} per step ", human(last(&outs))),
            &outs,
            Color::Yellow,
        );
        spark_u(
            f,
            cols[1],
            &format!(" in {} per step ", human(last(&ins))),
            &ins,
            Color::Magenta,
        );
        spark_u(
            f,
            cols[2],
            &format!(" updates included {} ", last(&inc)),
            &inc,
            Color::Blue,
        );
    }

    fn draw_defence(&self, f: &mut Frame, area: Rect) {
        let last = self.steps.back();
        let (pen, bans, rejected) = last.map_or((0, 0, 0), |s| (s.penalties, s.bans, s.rejected));
        let mut lines = vec![
            Line::from(format!(
                "penalties {pen}   bans {bans}   messages rejected {rejected}   checkpoint: {}",
                self.checkpoint
            )),
            Line::from(match last {
                Some(s) => format!(
                    "train {} ms   apply {} ms   own update {}   tokens applied {}",
                    s.train_ms,
                    s.apply_ms,
                    human(s.update_bytes),
                    s.included_tokens
                ),
                None => "waiting for the first applied step".into(),
            }),
        ];
        for (peer, reason, ban) in self.offences.iter().rev() {
            let what = if *ban { "banned" } else { "penalized" };
            let short: String = peer.chars().take(16).collect();
            lines.push(Line::styled(
                format!("{what} {short}…: {reason}"),
                Style::default().fg(if *ban { Color::Red } else { Color::Yellow }),
            ));
        }
        f.render_widget(
            Paragraph::new(lines).block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(" defences and checkpoints "),
            ),
            area,
        );
    }
}

/// Sparklines draw bars from 0: a loss is drawn as its height above the window's minimum
/// (scaled to 1,000 levels), so the shape of the descent shows, not the distance from 0.
fn inverted(v: &[f64]) -> Vec<u64> {
    let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let span = (hi - lo).max(1e-12);
    v.iter()
        .map(|x| 1 + ((x - lo) / span * 999.0).round() as u64)
        .collect()
}

fn spark_u(f: &mut Frame, area: Rect, title: &str, v: &[u64], c: Color) {
    // The newest values, as many as fit.
    let w = area.width.saturating_sub(2) as usize;
    let v = &v[v.len().saturating_sub(w)..];
    f.render_widget(
        Sparkline::default()
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(title.to_string()),
            )
            .data(v)
            .style(Style::default().fg(c)),
        area,
    );
}

/// Bytes as a person reads them.
fn human(b: u64) -> String {
    match b {
        b if b >= 10 << 20 => format!("{:.0} MB", b as f64 / 1048576.0),
        b if b >= 1 << 20 => format!("{:.1} MB", b as f64 / 1048576.0),
        b if b >= 10 << 10 => format!("{:.0} kB", b as f64 / 1024.0),
        b if b >= 1 << 10 => format!("{:.1} kB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// The running view: dropping it stops the thread and gives the terminal back.
pub struct Tui {
    pub feed: Feed,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Tui {
    /// Take over the terminal and start drawing `view`. `quit` is called (once) when the
    /// person presses q, Esc or Ctrl-C: raw mode turns Ctrl-C into a key, not a signal.
    pub fn start(mut view: View, quit: impl FnOnce() + Send + 'static) -> std::io::Result<Tui> {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let mut terminal = ratatui::try_init()?;
        let thread = std::thread::Builder::new()
            .name("tui".into())
            .spawn(move || {
                use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
                let mut quit = Some(quit);
                while !stopped.load(Ordering::Relaxed) {
                    while let Ok(u) = rx.try_recv() {
                        view.update(u);
                    }
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    if terminal.draw(|f| view.draw(f, now)).is_err() {
                        break;
                    }
                    if event::poll(Duration::from_millis(250)).unwrap_or(false) {
                        if let Ok(Event::Key(k)) = event::read() {
                            let ctrl_c = k.code == KeyCode::Char('c')
                                && k.modifiers.contains(KeyModifiers::CONTROL);
                            if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) {
                                if let Some(q) = quit.take() {
                                    q();
                                }
                            }
                        }
                    }
                }
                ratatui::restore();
            })?;
        Ok(Tui {
            feed: Feed(tx),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Tui {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn status(step: u64, loss: f64, eval: Option<f64>) -> StatusLine {
        StatusLine {
            node: "12D3KooWtest".into(),
            step,
            version: step + 1,
            loss: Some(loss),
            peers: 3,
            included: 4,
            update_bytes: 5770,
            bytes_out: 6000 + step,
            bytes_in: 24000,
            train_ms: 310,
            apply_ms: 12,
            digest: "abcdef0123456789abcdef".into(),
            t_ms: 0,
            rejected: 2,
            fetches: 9,
            tokens: 512,
            included_tokens: 2048,
            published_ms: None,
            arrivals: Default::default(),
            eval_loss: eval,
            penalties: 5,
            bans: 1,
        }
    }

    fn screen(v: &View, now: u64) -> String {
        let mut t = Terminal::new(TestBackend::new(120, 40)).expect("test backend");
        t.draw(|f| v.draw(f, now)).expect("draws");
        let buf = t.backend().buffer().clone();
        let mut s = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                s.push_str(buf[(x, y)].symbol());
            }
            s.push('\n');
        }
        s
    }

    #[test]
    fn every_field_the_issue_names_is_on_screen_and_moves_with_the_steps() {
        let log = LogRing::default();
        let mut v = View::new(
            "12D3KooWtest".into(),
            "tiny-local".into(),
            1_000,
            2_500,
            log.clone(),
        );
        let before = screen(&v, 500);
        assert!(before.contains("genesis in 0.5 s"), "{before}");
        assert!(before.contains("train loss: none yet"), "{before}");
        for s in 0..30u64 {
            let eval = (s % 10 == 9).then(|| 3.0 - s as f64 * 0.05);
            v.update(Update::Status(Box::new(status(
                s,
                3.4 - s as f64 * 0.04,
                eval,
            ))));
        }
        v.update(Update::Offence {
            peer: "12D3KooWbadbadbadbadbad".into(),
            reason: "spot check failed".into(),
            ban: true,
        });
        v.update(Update::Checkpoint("saved v30".into()));
        use tracing_subscriber::fmt::MakeWriter;
        write!(log.make_writer(), "INFO applied step=29\n").expect("ring");
        // 1,000 + 30 periods + 1,200 ms: step 30, 1.3 s left.
        let s = screen(&v, 1_000 + 30 * 2_500 + 1_200);
        for want in [
            "step 30 under way, 1.3 s left",
            "last applied 29 (version 30)",
            "digest abcdef012345",
            "peers 3",
            "train loss 2.2400",
            "eval loss 1.5500",
            "out 5.9 kB per step",
            "in 23 kB per step",
            "updates included 4",
            "penalties 5",
            "bans 1",
            "checkpoint: saved v30",
            "banned 12D3KooWbadbadba…: spot check failed",
            "INFO applied step=29",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
        }
        // The sparklines hold the steps: newer screens differ from older ones.
        v.update(Update::Status(Box::new(status(30, 9.0, None))));
        assert_ne!(s, screen(&v, 1_000 + 30 * 2_500 + 1_200));
    }

    #[test]
    fn the_history_and_the_log_stay_bounded() {
        let log = LogRing::default();
        let mut v = View::new("n".into(), "r".into(), 0, 1000, log.clone());
        for s in 0..(HISTORY as u64 * 3) {
            v.update(Update::Status(Box::new(status(s, 1.0, Some(1.0)))));
            log.push(&format!("line {s}\n"));
        }
        assert_eq!(v.steps.len(), HISTORY);
        assert_eq!(v.evals.len(), HISTORY);
        assert_eq!(log.last(usize::MAX).len(), LOG_LINES);
        assert_eq!(v.steps.back().map(|s| s.step), Some(HISTORY as u64 * 3 - 1));
    }

    #[test]
    fn a_full_queue_drops_updates_instead_of_blocking_the_node() {
        let (tx, rx) = std::sync::mpsc::sync_channel(2);
        let feed = Feed(tx);
        for s in 0..10 {
            feed.send(Update::Peers(s));
        }
        assert_eq!(rx.try_iter().count(), 2);
    }
}
