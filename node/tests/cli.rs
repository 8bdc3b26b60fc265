//! The `swarm` binary as a user runs it.

// A test: an unwrap that fails is a failing test, with its line (helpers included).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn swarm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_swarm"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("swarm-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn keygen_refuses_to_overwrite_and_id_matches() {
    let d = tmp("keys");
    let key = d.join("node.key");
    let out = swarm()
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap();
    assert!(id.starts_with("12D3KooW"), "{id}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let again = swarm()
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(!again.status.success());
    let shown = swarm().arg("id").arg(&key).output().unwrap();
    assert_eq!(String::from_utf8(shown.stdout).unwrap(), id);
}

#[test]
fn train_writes_report_and_plot() {
    let d = tmp("train");
    let report = d.join("r.json");
    let out = swarm()
        .args([
            "train",
            "--steps",
            "6",
            "--replicas",
            "2",
            "--eval-every",
            "3",
            "--eval-batches",
            "1",
            "--device",
            "cpu",
            "--report",
        ])
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("loss floor"), "{stdout}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["steps"].as_array().unwrap().len(), 6);
    assert!(r["steps"][0]["bytes_sent"].as_u64().unwrap() > 0);
    assert!(r["loss_floor"].as_f64().unwrap() > 0.0);
    let png = std::fs::read(report.with_extension("png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
}

#[test]
fn train_local_steps_counts_windows_and_bytes_per_token() {
    let d = tmp("train-local");
    let report = d.join("r.json");
    let out = swarm()
        .args([
            "train",
            "--optimizer",
            "local",
            "--inner-steps",
            "4",
            "--schedule",
            "overlap",
            "--steps",
            "8",
            "--replicas",
            "2",
            "--eval-every",
            "4",
            "--eval-batches",
            "1",
            "--device",
            "cpu",
            "--report",
        ])
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("bytes/token"), "{stdout}");
    assert!(stdout.contains("one per 4 batches"), "{stdout}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    // Two windows of four batches, recorded at the last batch of each.
    let steps = r["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0]["step"], 3);
    assert_eq!(steps[1]["step"], 7);
    assert!(steps.iter().all(|s| s["eval_loss"].is_number()));
    assert_eq!(r["options"]["optim"]["values"], "q2");
    assert_eq!(r["options"]["optim"]["topk"], 10);
}

#[test]
fn codec_encode_decode_and_size() {
    let d = tmp("codec");
    // Two tensors to compress, written as safetensors through tch.
    let a = train::rng::randn(&[128, 64], 1);
    let b = train::rng::randn(&[100], 2);
    let input = d.join("m.safetensors");
    tch::Tensor::write_safetensors(&[("a", a), ("b", b)], &input).unwrap();
    for (name, values) in [("u1.bin", "sign"), ("u2.bin", "sign")] {
        let out = swarm()
            .args([
                "codec", "encode", "--topk", "4", "--values", values, "--input",
            ])
            .arg(&input)
            .arg("--output")
            .arg(d.join(name))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dec = d.join("d.safetensors");
    let out = swarm()
        .args(["codec", "decode"])
        .arg(d.join("u1.bin"))
        .arg(d.join("u2.bin"))
        .arg("--output")
        .arg(&dec)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = tch::Tensor::read_safetensors(&dec).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(
        t.iter().find(|(n, _)| n == "a").unwrap().1.size(),
        vec![128, 64]
    );

    let out = swarm()
        .args(["codec", "size", "--model", "1.2b"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("one update"), "{s}");
}

/// `swarm codec bench` on `tiny`: every figure the issue names is printed and in the JSON.
#[test]
fn codec_bench_reports_encode_apply_and_memory() {
    let d = tmp("bench");
    let json = d.join("b.json");
    let out = swarm()
        .args([
            "codec",
            "bench",
            "--model",
            "tiny",
            "--repeat",
            "1",
            "--updates",
            "2,4",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "encode (median)",
        "GB/s",
        "apply, 2",
        "apply, 4",
        "peak resident memory",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(v["encode_s"].as_f64().unwrap() > 0.0);
    assert!(v["update_bytes"].as_u64().unwrap() > 0);
    assert_eq!(v["apply"].as_array().unwrap().len(), 2);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > v["params"].as_u64().unwrap() * 4);
    let _ = std::fs::remove_dir_all(&d);
}
