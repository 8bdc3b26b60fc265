//! Training reports (`swarm train --report`, `swarm demo`): loss beside AdamW, bytes sent.

use anyhow::Result;
use plotters::prelude::*;
use std::path::Path;
use train::run::TrainReport;

use super::{err, legend};

/// A report's family: the text in its label's last parentheses ("n1 (swarm)" → "swarm"), else
/// the whole label. Members of a family share a colour and one legend entry, so a demo's four
/// swarm nodes read as one method beside AdamW.
pub(crate) fn family(label: &str) -> &str {
    match (label.rfind('('), label.ends_with(')')) {
        (Some(i), true) => &label[i + 1..label.len() - 1],
        _ => label,
    }
}

/// Two panels over one step axis. Top: each report's train loss (thin) and eval loss (thick
/// line with points), one colour per family, and the corpus's loss floor (dashed) when it is
/// known. Bottom: bytes each node sends per step (log scale: AdamW's all-reduce and the
/// swarm's sparse updates are orders of magnitude apart).
pub(crate) fn loss_plot(reports: &[(String, TrainReport)], out: &Path) -> Result<()> {
    let root = BitMapBackend::new(out, (1000, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(560);
    let steps = x_extent(reports);
    draw_loss_panel(&top, reports, steps)?;
    draw_bytes_panel(&bottom, reports, steps)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The end of the step axis shared by both panels.
fn x_extent(reports: &[(String, TrainReport)]) -> f64 {
    // The x axis runs to the last step recorded: a local-steps report records one entry per
    // window, at the window's last batch, so counting entries cut its second half off.
    reports
        .iter()
        .filter_map(|(_, r)| r.steps.last().map(|s| s.step as usize + 1))
        .max()
        .unwrap_or(1)
        .max(1) as f64
}

/// The loss axis's range: from the lowest finite loss (train, eval or floor) to the highest
/// train loss after the first few steps.
fn loss_range(reports: &[(String, TrainReport)]) -> (f64, f64) {
    let all: Vec<f64> = reports
        .iter()
        .flat_map(|(_, r)| {
            r.steps
                .iter()
                .map(|s| s.train_loss)
                .chain(r.steps.iter().filter_map(|s| s.eval_loss))
                .chain(r.loss_floor)
        })
        .filter(|x| x.is_finite())
        .collect();
    let lo = all.iter().cloned().fold(f64::INFINITY, f64::min);
    let lo = if lo.is_finite() { lo } else { 0.0 };
    // Skip the first few steps' huge losses when choosing the top of the axis.
    let hi = reports
        .iter()
        .flat_map(|(_, r)| {
            r.steps
                .iter()
                .skip(r.steps.len() / 20)
                .map(|s| s.train_loss)
        })
        .filter(|x| x.is_finite())
        .fold(lo + 0.1, f64::max);
    (lo, hi)
}

/// The loss panel's title: model, optimizer and data for one report; the families compared
/// for several.
fn loss_title(reports: &[(String, TrainReport)]) -> String {
    match reports {
        [(_, r)] => format!(
            "{} · {} · {}",
            r.options.model.name,
            format!("{:?}", r.options.optimizer).to_lowercase(),
            short(&r.data)
        ),
        _ => format!("loss: {}", families(reports).join(" vs ")),
    }
}

/// The reports' families, in order of first appearance.
fn families(reports: &[(String, TrainReport)]) -> Vec<&str> {
    let mut fams: Vec<&str> = Vec::new();
    for (l, _) in reports {
        if !fams.contains(&family(l)) {
            fams.push(family(l));
        }
    }
    fams
}

/// A family's colour, and whether report `i` is its first (the one that gets the legend).
fn family_colour(reports: &[(String, TrainReport)], fams: &[&str], i: usize) -> (RGBColor, bool) {
    let palette = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    let f = family(&reports[i].0);
    let k = fams.iter().position(|x| *x == f).unwrap_or(0);
    let first = reports.iter().position(|(l, _)| family(l) == f) == Some(i);
    (palette[k % palette.len()], first)
}

/// The top panel: each report's train and eval loss, one colour per family, and the loss
/// floor when it is known.
fn draw_loss_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    reports: &[(String, TrainReport)],
    steps: f64,
) -> Result<()> {
    let (lo, hi) = loss_range(reports);
    let mut chart = ChartBuilder::on(area)
        .caption(loss_title(reports), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..steps, (lo - 0.05 * (hi - lo))..hi)
        .map_err(err)?;
    chart
        .configure_mesh()
        .y_desc("loss (nats/token)")
        .draw()
        .map_err(err)?;
    let fams = families(reports);
    let members = |f: &str| reports.iter().filter(|(l, _)| family(l) == f).count();
    for (i, (label, r)) in reports.iter().enumerate() {
        let (c, first) = family_colour(reports, &fams, i);
        let fam = family(label);
        let name = match members(fam) {
            1 => label.clone(),
            n => format!("{fam} ({n} nodes)"),
        };
        let s = chart
            .draw_series(LineSeries::new(
                r.steps.iter().map(|s| (s.step as f64, s.train_loss)),
                c.mix(0.35),
            ))
            .map_err(err)?;
        if first {
            s.label(format!("{name} train"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.mix(0.35)));
        }
        let evals: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter_map(|s| s.eval_loss.map(|e| (s.step as f64, e)))
            .collect();
        let s = chart
            .draw_series(LineSeries::new(evals.clone(), c.stroke_width(3)))
            .map_err(err)?;
        if first {
            s.label(format!("{name} eval (final {:.4})", r.final_eval_loss))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3))
                });
        }
        chart
            .draw_series(evals.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    if let Some(f) = reports.iter().find_map(|(_, r)| r.loss_floor) {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, f), (steps, f)],
                8,
                6,
                BLACK.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("loss floor {f:.4}"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    legend(&mut chart)?;

    Ok(())
}

/// The range of the bytes panel's log axis: a factor of two beyond the smallest and largest
/// nonzero bytes sent.
fn bytes_range(reports: &[(String, TrainReport)]) -> (f64, f64) {
    let sent: Vec<f64> = reports
        .iter()
        .flat_map(|(_, r)| r.steps.iter().map(|s| s.bytes_sent as f64))
        .filter(|b| *b > 0.0)
        .collect();
    let (bmin, bmax) = sent
        .iter()
        .fold((f64::INFINITY, 0f64), |(a, b), x| (a.min(*x), b.max(*x)));
    let (bmin, bmax) = if sent.is_empty() {
        (1.0, 10.0)
    } else {
        (bmin / 2.0, bmax * 2.0)
    };
    (bmin, bmax)
}

/// The bottom panel: bytes each node sends per step (log scale), one colour per family.
fn draw_bytes_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    reports: &[(String, TrainReport)],
    steps: f64,
) -> Result<()> {
    // Bytes each node sends per step, one colour per family as above.
    let (bmin, bmax) = bytes_range(reports);
    let fams = families(reports);
    let mut bytes = ChartBuilder::on(area)
        .caption("bytes sent per node per step", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..steps, (bmin..bmax).log_scale())
        .map_err(err)?;
    bytes
        .configure_mesh()
        .x_desc("step (batches per node)")
        .y_desc("bytes (log)")
        .y_label_formatter(&|b| human_bytes(*b))
        .draw()
        .map_err(err)?;
    for (i, (label, r)) in reports.iter().enumerate() {
        let (c, first) = family_colour(reports, &fams, i);
        let pts: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter(|s| s.bytes_sent > 0)
            .map(|s| (s.step as f64, s.bytes_sent as f64))
            .collect();
        let s = bytes
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?;
        if first {
            let fam = family(label).to_string();
            s.label(fam)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
    }
    legend(&mut bytes)?;
    Ok(())
}

fn human_bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.0} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.0} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.0} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

fn short(s: &str) -> String {
    s.split(':').next().unwrap_or(s).chars().take(60).collect()
}

/// Tokens one node trains between two of its sends: a batch, or a window of H for local steps.
fn tokens_per_send(r: &TrainReport) -> f64 {
    let o = &r.options;
    let hh = if o.optimizer == train::run::Optimizer::Local {
        o.optim.local.as_ref().map_or(16, |l| l.inner_steps.max(1))
    } else {
        1
    };
    (o.batch as f64 * o.model.seq_len as f64 * hh as f64).max(1.0)
}

/// Bytes one node sends per token it trains (the last record's send over its tokens).
pub(crate) fn bytes_per_token(r: &TrainReport) -> f64 {
    r.steps
        .last()
        .map_or(0.0, |s| s.bytes_sent as f64 / tokens_per_send(r))
}

/// Final eval loss of each report, its distance to the floor and to the first report.
pub(crate) fn summary_table(reports: &[(String, TrainReport)]) {
    let Some((_, base)) = reports.first() else {
        return;
    };
    println!(
        "{:<24} {:>10} {:>10} {:>9} {:>12} {:>10} {:>12} {:>9}",
        "run",
        "eval loss",
        "vs floor",
        "vs first",
        "sent B/send",
        "B/token",
        "recv B/send",
        "wall s"
    );
    for (label, r) in reports {
        let last = r.steps.last();
        println!(
            "{:<24} {:>10.4} {:>10} {:>+8.2}% {:>12} {:>10.2} {:>12} {:>9.1}",
            label,
            r.final_eval_loss,
            r.loss_floor
                .map(|f| format!("{:+.4}", r.final_eval_loss - f))
                .unwrap_or("-".into()),
            (r.final_eval_loss / base.final_eval_loss - 1.0) * 100.0,
            last.map(|s| s.bytes_sent).unwrap_or(0),
            bytes_per_token(r),
            last.map(|s| s.bytes_received).unwrap_or(0),
            r.wall_seconds
        );
    }
}

/// The loss-versus-bytes frontier: each report's final eval loss as a ratio to the first
/// report's (the reference, e.g. AdamW + all-reduce) against the bytes a node sends per token
/// it trains (log scale), one line per method (DeMo at several k, local steps at several H…),
/// so a compressor's figure of merit — how little it sends for how little loss it gives up —
/// reads at a glance, and methods that exchange every batch or every window compare fairly.
pub(crate) fn bytes_plot(reports: &[(String, TrainReport)], out: &Path) -> Result<()> {
    let Some((_, base)) = reports.first() else {
        return Ok(());
    };
    let reference = base.final_eval_loss;
    let pts: Vec<(String, String, f64, f64)> = reports
        .iter()
        .filter(|(_, r)| !r.steps.is_empty())
        .map(|(l, r)| {
            let method = format!("{:?}", r.options.optimizer).to_lowercase();
            (
                l.clone(),
                method,
                bytes_per_token(r).max(1e-3),
                r.final_eval_loss / reference,
            )
        })
        .collect();
    if pts.is_empty() {
        return Ok(());
    }
    let root = BitMapBackend::new(out, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (xmin, xmax) = pts
        .iter()
        .fold((f64::INFINITY, 0f64), |(a, b), p| (a.min(p.2), b.max(p.2)));
    let (ymin, ymax) = pts
        .iter()
        .fold((1.0f64, 1.0f64), |(a, b), p| (a.min(p.3), b.max(p.3)));
    let pad = 0.08 * (ymax - ymin).max(0.05);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "final eval loss / {} ({reference:.4}) against bytes sent per token trained",
                reports[0].0
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin / 2.0..xmax * 3.0).log_scale(),
            (ymin - pad)..(ymax + pad),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("bytes sent per node per token trained (log)")
        .y_desc("final eval loss / reference")
        .draw()
        .map_err(err)?;
    let mut methods: Vec<&str> = pts.iter().map(|p| p.1.as_str()).collect();
    methods.dedup();
    methods.sort();
    methods.dedup();
    for (i, m) in methods.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let mut line: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.1 == *m)
            .map(|p| (p.2, p.3))
            .collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(line.clone(), colour.stroke_width(2)))
            .map_err(err)?
            .label(m.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(
                line.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, colour.filled())),
            )
            .map_err(err)?;
    }
    chart
        .draw_series(
            pts.iter()
                .map(|(l, _, x, y)| Text::new(format!(" {l}"), (*x, *y), ("sans-serif", 14))),
        )
        .map_err(err)?;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(xmin / 2.0, 1.0), (xmax * 3.0, 1.0)],
            8,
            6,
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
    legend(&mut chart)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_of_one_swarm_are_one_family() {
        assert_eq!(family("n1 (swarm)"), "swarm");
        assert_eq!(family("n2 (swarm)"), "swarm");
        assert_eq!(family("adamw all-reduce"), "adamw all-reduce");
        assert_eq!(family("k(4) demo"), "k(4) demo");
    }

    #[test]
    fn the_loss_plot_has_two_panels_and_copes_with_missing_evals() {
        let opts = train::run::TrainOptions {
            model: protocol::config::ModelConfig::named("tiny", 32).expect("tiny exists"),
            optimizer: train::run::Optimizer::Demo,
            replicas: 4,
            steps: 50,
            batch: 4,
            seed: 0,
            optim: Default::default(),
            adamw_lr: 3e-3,
            adamw_wd: 0.1,
            eval_every: 10,
            eval_batches: 4,
            schedule: Default::default(),
            init: None,
        };
        let rep = |eval: bool, bytes: u64| TrainReport {
            options: opts.clone(),
            data: "synthetic".into(),
            params: 1,
            device: "Cpu".into(),
            threads: 1,
            loss_floor: Some(1.0),
            update_bytes: None,
            steps: (0..50u32)
                .map(|i| train::run::StepRecord {
                    step: i,
                    train_loss: 3.0 - i as f64 * 0.03,
                    eval_loss: (eval && i % 10 == 9).then_some(3.1 - i as f64 * 0.03),
                    bytes_sent: bytes,
                    ..Default::default()
                })
                .collect(),
            final_eval_loss: 1.6,
            wall_seconds: 1.0,
            codec_fraction: None,
            final_digest: String::new(),
        };
        let reports = vec![
            ("n1 (swarm)".to_string(), rep(true, 6_000)),
            ("n2 (swarm)".to_string(), rep(false, 6_000)),
            ("adamw all-reduce".to_string(), rep(true, 3_000_000)),
        ];
        let dir = std::env::temp_dir().join(format!("swarm-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let out = dir.join("p.png");
        loss_plot(&reports, &out).expect("plots");
        let png = std::fs::read(&out).expect("written");
        assert_eq!(&png[1..4], b"PNG");
        // IHDR: width and height, big-endian, at bytes 16..24.
        let w = u32::from_be_bytes(png[16..20].try_into().expect("4 bytes"));
        let h = u32::from_be_bytes(png[20..24].try_into().expect("4 bytes"));
        assert_eq!((w, h), (1000, 820));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
