//! Virtual time: a priority queue of events keyed by (time, insertion sequence).
//!
//! The sequence number breaks ties in insertion order, so two events at the same microsecond
//! are always handled in the same order and a run is a pure function of its seed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Microseconds of virtual time. The engine speaks milliseconds; the network needs finer
/// resolution (a 300-byte header takes 24 µs at 100 Mbit/s).
pub type Micros = u64;

pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Micros, u64, usize)>>,
    // Payloads live beside the heap so `E` needs no `Ord`; slots are reused through `free`.
    slots: Vec<Option<E>>,
    free: Vec<usize>,
    seq: u64,
    now: Micros,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            seq: 0,
            now: 0,
        }
    }
}

impl<E> EventQueue<E> {
    pub fn new(start: Micros) -> Self {
        EventQueue {
            now: start,
            ..Default::default()
        }
    }
    pub fn now(&self) -> Micros {
        self.now
    }
    pub fn len(&self) -> usize {
        self.heap.len()
    }
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
    /// Schedule `e` at `at` (events in the past run at the current time: time never goes back).
    pub fn push(&mut self, at: Micros, e: E) {
        let at = at.max(self.now);
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(e);
                i
            }
            None => {
                self.slots.push(Some(e));
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, slot)));
    }
    pub fn peek_time(&self) -> Option<Micros> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }
    /// The next event, advancing the clock to it.
    pub fn pop(&mut self) -> Option<(Micros, E)> {
        let Reverse((t, _, slot)) = self.heap.pop()?;
        self.now = t;
        self.free.push(slot);
        Some((t, self.slots[slot].take().expect("live slot")))
    }
    /// The next event if it is due by `end`.
    pub fn pop_until(&mut self, end: Micros) -> Option<(Micros, E)> {
        if self.peek_time()? > end {
            return None;
        }
        self.pop()
    }
    /// Move the clock forward to `t` (after the queue was drained up to it).
    pub fn advance(&mut self, t: Micros) {
        self.now = self.now.max(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_time_then_insertion() {
        let mut q = EventQueue::new(0);
        q.push(5, "c");
        q.push(1, "a");
        q.push(5, "d");
        q.push(1, "b");
        let got: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(got, vec![(1, "a"), (1, "b"), (5, "c"), (5, "d")]);
        q.push(0, "late");
        assert_eq!(q.pop(), Some((5, "late")), "the clock never goes back");
    }
}
