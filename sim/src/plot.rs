//! PNG figures of a run's metrics: loss (with the AdamW baseline), bytes per node per step,
//! the step-latency distribution, and updates included/excluded per step.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::Metrics;
use crate::SimError;

fn e<E: std::fmt::Display>(x: E) -> SimError {
    SimError::Plot(x.to_string())
}

type Series = (String, Vec<(f64, f64)>, RGBColor);

fn lines(
    out: &Path,
    title: &str,
    ylabel: &str,
    series: &[Series],
    log_y: bool,
) -> Result<(), SimError> {
    let root = BitMapBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let pts = series
        .iter()
        .flat_map(|s| s.1.iter())
        .filter(|p| p.1.is_finite() && (!log_y || p.1 > 0.0));
    let (mut x1, mut y0, mut y1) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for p in pts {
        x1 = x1.max(p.0);
        y0 = y0.min(p.1);
        y1 = y1.max(p.1);
    }
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc(ylabel)
                .draw()
                .map_err(e)?;
            for (label, v, c) in series {
                let c = *c;
                let v: Vec<(f64, f64)> =
                    v.iter().copied().filter(|p| !log_y || p.1 > 0.0).collect();
                chart
                    .draw_series(LineSeries::new(v, c.stroke_width(2)))
                    .map_err(e)?
                    .label(label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(e)?;
        }};
    }
    if log_y {
        draw!(b
            .build_cartesian_2d(0f64..x1, (y0 * 0.8..y1 * 1.25).log_scale())
            .map_err(e)?);
    } else {
        let pad = 0.05 * (y1 - y0);
        draw!(b
            .build_cartesian_2d(0f64..x1, (y0 - pad).min(0.0)..y1 + pad)
            .map_err(e)?);
    }
    root.present().map_err(e)?;
    Ok(())
}

fn histogram(out: &Path, title: &str, hist: &[(f64, u64)]) -> Result<(), SimError> {
    let root = BitMapBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let n = hist.len().max(1);
    let top = hist.iter().map(|h| h.1).max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0..n, 0u64..top + top / 10 + 1)
        .map_err(e)?;
    let labels: Vec<String> = hist.iter().map(|h| format!("≤{:.0}", h.0)).collect();
    chart
        .configure_mesh()
        .x_desc("step latency (ms, bucket upper bound)")
        .y_desc("node-steps")
        .x_labels(n.min(12))
        .x_label_formatter(&|i| labels.get(*i).cloned().unwrap_or_default())
        .draw()
        .map_err(e)?;
    chart
        .draw_series(
            hist.iter()
                .enumerate()
                .map(|(i, h)| Rectangle::new([(i, 0), (i + 1, h.1)], BLUE.mix(0.6).filled())),
        )
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// Write loss.png, bytes.png, latency.png and included.png into `dir`.
pub fn all(m: &Metrics, dir: &Path) -> Result<(), SimError> {
    std::fs::create_dir_all(dir).map_err(|x| SimError::Io(format!("{}: {x}", dir.display())))?;
    let st = &m.steps;
    let xs = |f: &dyn Fn(&crate::metrics::StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        st.iter()
            .filter_map(|s| f(s).map(|y| (s.step as f64, y)))
            .collect()
    };
    let t = format!("{} · {} nodes · {} mode", m.scenario, m.nodes, m.mode);
    // A real trainer reports train losses; its `loss` is eval loss on held-out batches.
    let real = st.iter().any(|s| s.train_loss.is_some());
    let mut curves = vec![
        (
            if real {
                "DeMo over the simulated swarm (eval)".to_string()
            } else {
                "DeMo over the simulated swarm".into()
            },
            xs(&|s| s.loss),
            BLUE,
        ),
        (
            "AdamW + all-reduce baseline".into(),
            xs(&|s| Some(s.baseline_loss).filter(|l| l.is_finite())),
            RED,
        ),
    ];
    if real {
        curves.push((
            "DeMo: mean train loss of the nodes".into(),
            xs(&|s| s.train_loss),
            GREEN,
        ));
    }
    lines(
        &dir.join("loss.png"),
        &if real {
            format!("{t}: loss (nats)")
        } else {
            format!("{t}: objective (optimum 0)")
        },
        "loss",
        &curves,
        !real,
    )?;
    let mb = 1e6;
    lines(
        &dir.join("bytes.png"),
        &format!("{t}: bytes per node per step"),
        "MB",
        &[
            ("down, mean".into(), xs(&|s| Some(s.down_mean / mb)), BLUE),
            (
                "down, max".into(),
                xs(&|s| Some(s.down_max as f64 / mb)),
                CYAN,
            ),
            ("up, mean".into(), xs(&|s| Some(s.up_mean / mb)), RED),
            (
                "up, max".into(),
                xs(&|s| Some(s.up_max as f64 / mb)),
                MAGENTA,
            ),
        ],
        false,
    )?;
    histogram(
        &dir.join("latency.png"),
        &format!("{t}: step latency"),
        &m.latency_hist_ms,
    )?;
    lines(
        &dir.join("included.png"),
        &format!("{t}: updates per step"),
        "updates",
        &[
            ("produced".into(), xs(&|s| Some(s.produced as f64)), BLACK),
            (
                "included (mean over nodes)".into(),
                xs(&|s| Some(s.included_mean)),
                BLUE,
            ),
            (
                "included (min)".into(),
                xs(&|s| Some(s.included_min as f64)),
                CYAN,
            ),
            (
                "excluded (mean)".into(),
                xs(&|s| Some(s.excluded_mean)),
                RED,
            ),
        ],
        false,
    )?;
    Ok(())
}

/// A grouped bar chart: one group per category, one bar per series (colours in turn), a zero
/// line; non-finite values are left out. For the attack measurement's "% worse" figure.
pub fn bars(
    out: &Path,
    title: &str,
    ylabel: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<(), SimError> {
    const COLOURS: [RGBColor; 5] = [BLUE, RED, GREEN, MAGENTA, CYAN];
    let root = BitMapBackend::new(out, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let vals = series
        .iter()
        .flat_map(|s| s.1.iter())
        .filter(|v| v.is_finite());
    let (mut y0, mut y1) = (0.0f64, 0.0f64);
    for &v in vals {
        y0 = y0.min(v);
        y1 = y1.max(v);
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let pad = 0.05 * (y1 - y0);
    let n = categories.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n as f64, (y0 - pad)..(y1 + pad))
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 {
                categories.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(ylabel)
        .draw()
        .map_err(e)?;
    let width = 0.8 / series.len().max(1) as f64;
    for (si, (label, v)) in series.iter().enumerate() {
        let c = COLOURS[si % COLOURS.len()];
        chart
            .draw_series(
                v.iter()
                    .enumerate()
                    .filter(|p| p.1.is_finite())
                    .map(|(ci, &y)| {
                        let x = ci as f64 + 0.1 + si as f64 * width;
                        Rectangle::new([(x, 0.0), (x + width * 0.9, y)], c.mix(0.75).filled())
                    }),
            )
            .map_err(e)?
            .label(label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (n as f64, 0.0)],
            BLACK.stroke_width(1),
        )))
        .map_err(e)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}
