//! The engine's one majority rule. Three decisions count votes — which updates a step's
//! summaries list (`round::listed`), which digest the swarm attests for a version
//! (`sync::swarm_digest`), and whether this node has been outvoted (`sync::check_desync`) —
//! and all three ask the same question: did more than half of those who voted choose this?

use std::collections::BTreeMap;

/// Votes per choice, and how many voted (a voter may choose several things, or none).
#[derive(Debug)]
pub(super) struct Tally<K> {
    votes: BTreeMap<K, u32>,
    voters: u32,
}

impl<K: Ord + Copy> Tally<K> {
    pub(super) fn new() -> Tally<K> {
        Tally {
            votes: BTreeMap::new(),
            voters: 0,
        }
    }

    /// One more voter, choosing `choices` (each counted once per call).
    pub(super) fn voter(&mut self, choices: impl IntoIterator<Item = K>) {
        self.voters += 1;
        for k in choices {
            *self.votes.entry(k).or_default() += 1;
        }
    }

    /// Whether `count` votes are more than half the voters: then no other choice can have as
    /// many, so a strict majority needs no tie rule.
    fn strict(&self, count: u32) -> bool {
        2 * count > self.voters
    }

    /// The choice of a strict majority of the voters, with at least `quorum` votes.
    pub(super) fn majority(&self, quorum: u32) -> Option<K> {
        self.votes
            .iter()
            .find(|(_, &c)| c >= quorum && self.strict(c))
            .map(|(k, _)| *k)
    }

    /// Every choice (`all`), or only those of a strict majority, in order.
    pub(super) fn chosen(&self, all: bool) -> impl Iterator<Item = K> + '_ {
        self.votes
            .iter()
            .filter(move |(_, &c)| all || self.strict(c))
            .map(|(k, _)| *k)
    }

    /// How many distinct things were chosen.
    pub(super) fn choices(&self) -> usize {
        self.votes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strict_majority_with_a_quorum_wins_and_a_half_does_not() {
        let mut t = Tally::new();
        t.voter([1u8]);
        t.voter([1]);
        t.voter([2]);
        assert_eq!(t.majority(2), Some(1));
        assert_eq!(t.majority(3), None, "below the quorum");
        t.voter([2]);
        assert_eq!(t.majority(1), None, "two of four is not a majority");
        // A voter who chooses nothing still counts against every choice.
        t.voter([]);
        t.voter([1]);
        assert_eq!(t.majority(1), None);
        assert_eq!(t.chosen(true).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(t.chosen(false).count(), 0);
        assert_eq!(t.choices(), 2);
    }
}
