//! A simulator run's figures, from the data it returns: `metrics.json` (loss with the AdamW
//! baseline, bytes per node per step, the step-latency distribution, updates included and
//! excluded per step) and the attack sweep's `attacks.json` (how much worse each attack makes
//! the final loss).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use sim::adversary::Row;
use sim::metrics::{Metrics, StepMetrics};

use super::{bars, histogram, lines};

/// Write loss.png, bytes.png, latency.png and included.png into `dir`.
pub(crate) fn metrics(m: &Metrics, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|x| anyhow!("{}: {x}", dir.display()))?;
    let st = &m.steps;
    let xs = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
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
        "step latency (ms, bucket upper bound)",
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

/// `attacks.png`: per attack, how much worse the final loss is than the honest-only run, one
/// bar per hostile fraction, defences on (the rows with `defence == "full"`).
pub(crate) fn attacks(rows: &[Row], title: &str, out: &Path) -> Result<()> {
    let full: Vec<&Row> = rows.iter().filter(|r| r.defence == "full").collect();
    let mut cats: Vec<String> = Vec::new();
    let mut fractions: Vec<f64> = Vec::new();
    for r in &full {
        if !cats.contains(&r.attack) {
            cats.push(r.attack.clone());
        }
        if !fractions.contains(&r.fraction) {
            fractions.push(r.fraction);
        }
    }
    fractions.sort_by(f64::total_cmp);
    let series: Vec<(String, Vec<f64>)> = fractions
        .iter()
        .map(|&f| {
            let v = cats
                .iter()
                .map(|c| {
                    full.iter()
                        .find(|r| &r.attack == c && r.fraction == f)
                        .map_or(f64::NAN, |r| r.worse_pct)
                })
                .collect();
            (format!("{:.0}% hostile", f * 100.0), v)
        })
        .collect();
    bars(out, title, "% worse", &cats, &series)
}
