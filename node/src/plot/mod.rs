//! Every PNG the project draws, in one place: the simulator and the trainer return data
//! (`sim::metrics::Metrics`, `sim::adversary::Row`, `train::run::TrainReport`, all JSON), and this
//! module turns it into pictures. `swarm plot FILE…` draws any of those files after the fact,
//! so a run written by a simulator example without libtorch can be drawn later.
//!
//! * [`report`]: training reports (`swarm train`, `swarm demo`): loss beside AdamW, bytes.
//! * [`sim`]: a simulator run's metrics (loss, bytes, latency, included) and the attack sweep.
//! * Here: the chart pieces both use (line chart, histogram, grouped bars, the legend's style).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::CoordTranslate;
use plotters::prelude::*;

pub(crate) mod report;
pub(crate) mod sim;

pub(crate) use report::{bytes_plot, loss_plot, summary_table};

/// plotters' errors carry the backend's error type; callers only need the message.
fn err<E: std::fmt::Display>(x: E) -> anyhow::Error {
    anyhow!("plot: {x}")
}

/// The one legend style: upper right, on a translucent white box with a black border.
fn legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> Result<()>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)
}

/// One named line of a chart.
pub(crate) type Series = (String, Vec<(f64, f64)>, RGBColor);

/// A line chart over a step axis starting at 0; `log_y` drops non-positive points. Non-finite
/// points do not stretch the axes.
pub(crate) fn lines(
    out: &Path,
    title: &str,
    ylabel: &str,
    series: &[Series],
    log_y: bool,
) -> Result<()> {
    let root = BitMapBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
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
    // The linear and the log chart are different types: one macro draws either.
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc(ylabel)
                .draw()
                .map_err(err)?;
            for (label, v, c) in series {
                let c = *c;
                let v: Vec<(f64, f64)> =
                    v.iter().copied().filter(|p| !log_y || p.1 > 0.0).collect();
                chart
                    .draw_series(LineSeries::new(v, c.stroke_width(2)))
                    .map_err(err)?
                    .label(label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }
            legend(&mut chart)?;
        }};
    }
    if log_y {
        draw!(b
            .build_cartesian_2d(0f64..x1, (y0 * 0.8..y1 * 1.25).log_scale())
            .map_err(err)?);
    } else {
        let pad = 0.05 * (y1 - y0);
        draw!(b
            .build_cartesian_2d(0f64..x1, (y0 - pad).min(0.0)..y1 + pad)
            .map_err(err)?);
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A histogram of `(bucket upper bound, count)`.
pub(crate) fn histogram(out: &Path, title: &str, xlabel: &str, hist: &[(f64, u64)]) -> Result<()> {
    let root = BitMapBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = hist.len().max(1);
    let top = hist.iter().map(|h| h.1).max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0..n, 0u64..top + top / 10 + 1)
        .map_err(err)?;
    let labels: Vec<String> = hist.iter().map(|h| format!("≤{:.0}", h.0)).collect();
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc("node-steps")
        .x_labels(n.min(12))
        .x_label_formatter(&|i| labels.get(*i).cloned().unwrap_or_default())
        .draw()
        .map_err(err)?;
    chart
        .draw_series(
            hist.iter()
                .enumerate()
                .map(|(i, h)| Rectangle::new([(i, 0), (i + 1, h.1)], BLUE.mix(0.6).filled())),
        )
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// A grouped bar chart: one group per category, one bar per series (colours in turn), a zero
/// line; non-finite values are left out.
pub(crate) fn bars(
    out: &Path,
    title: &str,
    ylabel: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<()> {
    const COLOURS: [RGBColor; 5] = [BLUE, RED, GREEN, MAGENTA, CYAN];
    let root = BitMapBackend::new(out, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
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
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            // Label only the middle of each group.
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 {
                categories.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(ylabel)
        .draw()
        .map_err(err)?;
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
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (n as f64, 0.0)],
            BLACK.stroke_width(1),
        )))
        .map_err(err)?;
    legend(&mut chart)?;
    root.present().map_err(err)?;
    Ok(())
}

/// What a JSON file given to `swarm plot` holds, told apart by its shape.
pub(crate) enum Input {
    /// `swarm train --report` / `swarm demo`'s per-node reports.
    Train(Box<train::run::TrainReport>),
    /// A simulator run's `metrics.json` (`swarm sim`, `sim` examples).
    Sim(Box<::sim::metrics::Metrics>),
    /// The attack sweep's `attacks.json` (`cargo run -p sim --example attacks`).
    Attacks(Vec<::sim::adversary::Row>),
}

impl Input {
    pub(crate) fn read(path: &Path) -> Result<Input> {
        let bytes = std::fs::read(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        if let Ok(r) = serde_json::from_slice(&bytes) {
            return Ok(Input::Train(Box::new(r)));
        }
        if let Ok(m) = serde_json::from_slice(&bytes) {
            return Ok(Input::Sim(Box::new(m)));
        }
        if let Ok(rows) = serde_json::from_slice(&bytes) {
            return Ok(Input::Attacks(rows));
        }
        Err(anyhow!(
            "{}: not a swarm train report, a simulator metrics.json or an attack sweep's attacks.json",
            path.display()
        ))
    }
}

/// `swarm plot FILES --out OUT`: draw whatever the files are (see [`Input`]).
pub(crate) fn draw(files: &[std::path::PathBuf], out: &Path) -> Result<()> {
    let mut reports = Vec::new();
    for p in files {
        let one = files.len() == 1;
        match Input::read(p)? {
            Input::Train(r) => {
                let label = p
                    .file_stem()
                    .map(|s| s.to_string_lossy().to_string())
                    .unwrap_or_default();
                reports.push((label, *r));
            }
            Input::Sim(m) if one => {
                sim::metrics(&m, out)?;
                println!("wrote loss.png, bytes.png, latency.png, included.png to {}", out.display());
                return Ok(());
            }
            Input::Attacks(rows) if one => {
                let title = "final loss vs honest-only, defences on";
                sim::attacks(&rows, title, out)?;
                println!("wrote {}", out.display());
                return Ok(());
            }
            _ => {
                return Err(anyhow!(
                    "{}: a simulator metrics.json or attacks.json is drawn alone; only train reports combine",
                    p.display()
                ))
            }
        }
    }
    loss_plot(&reports, out)?;
    summary_table(&reports);
    println!("wrote {}", out.display());
    if reports.len() > 1 {
        let stem = out
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let bytes = out.with_file_name(format!("{stem}-bytes.png"));
        bytes_plot(&reports, &bytes)?;
        println!("wrote {}", bytes.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png_size(p: &Path) -> (u32, u32) {
        let png = std::fs::read(p).expect("written");
        assert_eq!(&png[1..4], b"PNG", "{}", p.display());
        // IHDR: width and height, big-endian, at bytes 16..24.
        let w = u32::from_be_bytes(png[16..20].try_into().expect("4 bytes"));
        let h = u32::from_be_bytes(png[20..24].try_into().expect("4 bytes"));
        (w, h)
    }

    /// `swarm plot` tells a simulator run and an attack sweep apart by their JSON and draws
    /// each (the simulator itself draws nothing).
    #[test]
    fn simulator_metrics_and_attack_sweeps_are_drawn_from_their_json() {
        let dir = std::env::temp_dir().join(format!("swarm-plot-sim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut m = ::sim::metrics::Metrics {
            scenario: "test".into(),
            nodes: 4,
            latency_hist_ms: vec![(100.0, 3), (200.0, 5)],
            ..Default::default()
        };
        for s in 0..10u64 {
            m.steps.push(step(s));
        }
        let metrics = dir.join("metrics.json");
        std::fs::write(&metrics, m.to_json()).expect("write");
        let out = dir.join("sim");
        draw(std::slice::from_ref(&metrics), &out).expect("draws");
        for f in ["loss.png", "bytes.png", "latency.png", "included.png"] {
            assert_eq!(png_size(&out.join(f)), (900, 540));
        }
        let row = |attack: &str, fraction: f64, worse_pct: f64| ::sim::adversary::Row {
            attack: attack.into(),
            fraction,
            defence: "full".into(),
            hostile_nodes: 1,
            final_loss: 1.0,
            honest_loss: 1.0,
            worse_pct,
            absent_loss: 1.0,
            worse_vs_absent_pct: 0.0,
            stats: Default::default(),
            rejected: 0,
            desyncs: 0,
        };
        let rows = vec![
            row("noise", 0.1, 0.5),
            row("noise", 0.25, 1.5),
            row("alie", 0.1, -0.2),
        ];
        let attacks = dir.join("attacks.json");
        std::fs::write(&attacks, serde_json::to_string(&rows).expect("json")).expect("write");
        let png = dir.join("attacks.png");
        draw(std::slice::from_ref(&attacks), &png).expect("draws");
        assert_eq!(png_size(&png), (1200, 600));
        // A train report and a simulator run do not combine into one picture.
        assert!(draw(&[metrics.clone(), metrics], &dir.join("x.png")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn step(s: u64) -> ::sim::metrics::StepMetrics {
        ::sim::metrics::StepMetrics {
            step: s,
            loss: Some(1.0 / (s + 1) as f64),
            baseline_loss: 0.9 / (s + 1) as f64,
            down_mean: 1e6,
            produced: 4,
            included_mean: 3.5,
            ..Default::default()
        }
    }
}
