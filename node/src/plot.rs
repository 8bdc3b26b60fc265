//! PNG plots of training reports.

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;
use train::run::Report;

/// Loss against step: each report's train loss (thin) and eval loss (thick, with points), and
/// the corpus's loss floor when it is known.
pub fn loss_plot(reports: &[(String, Report)], out: &Path) -> Result<()> {
    let root = BitMapBackend::new(out, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    // The x axis runs to the last step recorded: a local-steps report records one entry per
    // window, at the window's last batch, so counting entries cut its second half off.
    let steps = reports
        .iter()
        .filter_map(|(_, r)| r.steps.last().map(|s| s.step as usize + 1))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let all: Vec<f64> = reports
        .iter()
        .flat_map(|(_, r)| r.steps.iter().map(|s| s.train_loss).chain(r.loss_floor))
        .filter(|x| x.is_finite())
        .collect();
    let lo = all.iter().cloned().fold(f64::INFINITY, f64::min);
    // Skip the first few steps' huge losses when choosing the top of the axis.
    let hi = reports
        .iter()
        .flat_map(|(_, r)| {
            r.steps
                .iter()
                .skip(r.steps.len() / 20)
                .map(|s| s.train_loss)
        })
        .fold(lo + 0.1, f64::max);
    let title = match reports {
        [(_, r)] => format!(
            "{} · {} · {}",
            r.options.model.name,
            format!("{:?}", r.options.optimizer).to_lowercase(),
            short(&r.data)
        ),
        _ => format!(
            "loss: {}",
            reports
                .iter()
                .map(|(l, _)| l.as_str())
                .collect::<Vec<_>>()
                .join(" vs ")
        ),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..steps, (lo - 0.05 * (hi - lo))..hi)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats/token)")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    let palette = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (label, r)) in reports.iter().enumerate() {
        let c = palette[i % palette.len()];
        chart
            .draw_series(LineSeries::new(
                r.steps.iter().map(|s| (s.step as f64, s.train_loss)),
                c.mix(0.35),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("{label} train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.mix(0.35)));
        let evals: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter_map(|s| s.eval_loss.map(|e| (s.step as f64, e)))
            .collect();
        chart
            .draw_series(LineSeries::new(evals.clone(), c.stroke_width(3)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("{label} eval (final {:.4})", r.final_eval_loss))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart
            .draw_series(evals.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    if let Some(f) = reports.iter().find_map(|(_, r)| r.loss_floor) {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, f), (steps, f)],
                8,
                6,
                BLACK.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("loss floor {f:.4}"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

fn short(s: &str) -> String {
    s.split(':').next().unwrap_or(s).chars().take(60).collect()
}

/// Tokens one node trains between two of its sends: a batch, or a window of H for local steps.
fn tokens_per_send(r: &Report) -> f64 {
    let o = &r.options;
    let hh = if o.optimizer == train::run::Optimizer::Local {
        o.optim.local.as_ref().map_or(16, |l| l.inner_steps.max(1))
    } else {
        1
    };
    (o.batch as f64 * o.model.seq_len as f64 * hh as f64).max(1.0)
}

/// Bytes one node sends per token it trains (the last record's send over its tokens).
pub fn bytes_per_token(r: &Report) -> f64 {
    r.steps
        .last()
        .map_or(0.0, |s| s.bytes_sent as f64 / tokens_per_send(r))
}

/// Final eval loss of each report, its distance to the floor and to the first report.
pub fn summary_table(reports: &[(String, Report)]) {
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
pub fn bytes_plot(reports: &[(String, Report)], out: &Path) -> Result<()> {
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
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
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
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("bytes sent per node per token trained (log)")
        .y_desc("final eval loss / reference")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
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
            .map_err(|e| anyhow!("{e}"))?
            .label(m.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(
                line.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, colour.filled())),
            )
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .draw_series(
            pts.iter()
                .map(|(l, _, x, y)| Text::new(format!(" {l}"), (*x, *y), ("sans-serif", 14))),
        )
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(xmin / 2.0, 1.0), (xmax * 3.0, 1.0)],
            8,
            6,
            BLACK.stroke_width(1),
        ))
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
