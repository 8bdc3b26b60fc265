//! Why a scenario cannot run: a file that cannot be read or parsed, settings that contradict
//! each other, or (with the `torch` feature) a trainer that cannot start.

use std::path::PathBuf;

use protocol::run::RunConfigError;
use thiserror::Error;

/// Why a scenario cannot run. An error that caused it is its source; a [`ScenarioError`]
/// (the scenario's own settings) has none.
#[derive(Debug, Error)]
pub enum SimError {
    /// A scenario, or the run file it names, could not be read.
    #[error("i/o: {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The scenario does not parse.
    #[error("scenario: {0}")]
    Parse(#[source] Box<toml::de::Error>),
    /// The run file a scenario names does not parse.
    #[error("scenario: {path}: {source}")]
    RunFile {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    /// The run the scenario makes is not one a node would accept.
    #[error("scenario: {0}")]
    Run(#[source] RunConfigError),
    /// The scenario's settings contradict each other or the simulator.
    #[error("scenario: {0}")]
    Scenario(ScenarioError),
    /// The `tiny` trainer's corpus could not be opened.
    #[cfg(feature = "torch")]
    #[error("scenario: {0}")]
    Corpus(#[source] train::TrainError),
    /// The AdamW baseline of the `tiny` trainer failed.
    #[cfg(feature = "torch")]
    #[error("scenario: AdamW baseline: {0}")]
    Baseline(#[source] train::TrainError),
}

impl From<ScenarioError> for SimError {
    fn from(e: ScenarioError) -> SimError {
        SimError::Scenario(e)
    }
}

/// What is wrong with a scenario's settings.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ScenarioError {
    #[error("no nodes: add a [[class]] with count > 0")]
    NoNodes,
    #[error("steps must be at least 1")]
    NoSteps,
    #[error("timing: grace ({grace}) + summary ({summary}) must fit in period ({period})")]
    Timing {
        grace: u64,
        summary: u64,
        period: u64,
    },
    #[error(
        "engine mode: at most 250 nodes (the run's max_updates_per_step is 256); use mode = \
         \"flow\""
    )]
    TooManyForEngine,
    #[error("defence = \"{0}\": use \"full\", \"off\" or a [defence] table")]
    UnknownDefence(String),
    /// An attack's parameter out of its range (`attacker` is the attack's label).
    #[error("attacker {attacker}: parameter out of range")]
    AttackParameter { attacker: String },
    #[error("attacker {attacker}: fraction must be in [0, 1)")]
    AttackerFraction { attacker: &'static str },
    #[error("attacker {attacker}: give nodes or a fraction")]
    AttackerNobody { attacker: &'static str },
    #[error("attacker {attacker}: no node {node}")]
    AttackerNoNode { attacker: &'static str, node: usize },
    /// An attack the flow model (which has no engines) cannot carry out.
    #[error("attacker {attacker}: engine mode only")]
    AttackerInFlow { attacker: &'static str },
    #[error("checkpoint_liar: no node {0}")]
    LiarNoNode(usize),
    #[error("checkpoint_liar: engine mode only")]
    LiarInFlow,
    #[error("join: no class {0}")]
    JoinNoClass(usize),
    #[error("trainer kind \"tiny\" runs in engine mode only")]
    TinyInFlow,
    #[error("trainer: batch, threads and eval_batches must be at least 1")]
    TinyZero,
    #[error(
        "trainer kind \"tiny\" needs the simulator built with the `torch` feature (`swarm sim` \
         has it; `cargo run -p sim --features torch ...`)"
    )]
    TinyNeedsTorch,
    #[error(
        "trainer kind \"tiny\": the simulator trains on the run's synthetic corpus only \
         ([data.Synthetic] in the run file)"
    )]
    TinyNeedsSynthetic,
    #[error("data vocabulary {data} exceeds the model's {model}")]
    VocabTooLarge { data: usize, model: u32 },
    #[error("run: batch_seqs must be at least 1")]
    NoBatch,
    /// More batches than the AdamW baseline can count (`u32`).
    #[error("{0} steps: too many for the baseline")]
    TooManySteps(u64),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn messages_name_the_setting_and_keep_the_cause() {
        let e = SimError::from(ScenarioError::AttackerNoNode {
            attacker: "noise",
            node: 7,
        });
        assert_eq!(e.to_string(), "scenario: attacker noise: no node 7");
        assert!(e.source().is_none());
        let e = crate::Scenario::from_toml("steps = [").expect_err("not TOML");
        assert!(matches!(e, SimError::Parse(_)));
        assert!(e.to_string().starts_with("scenario: "));
        assert!(e.source().is_some());
    }
}
