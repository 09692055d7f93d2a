//! A linearizability checker in the style of Knossos and Porcupine: the
//! Wing–Gong search with Lowe's memoisation, over one object's history (the
//! caller partitions a history by key: operations on different keys commute,
//! so the whole is linearizable when every key's part is — P-compositionality).
//!
//! An operation is a call, a response and the instants of both on one
//! logical clock shared by every caller. An operation without a response
//! (its caller gave up, crashed, or the store did not answer) is *pending*:
//! it may have taken effect at any point after its call, or never; the
//! search may place it anywhere after its call, with any answer, or leave
//! it out.
//!
//! Written here rather than taken from a crate: `lincheck` explores its own
//! executions under loom (it checks no recorded history), `todc-utils`'s WGL
//! checker has no pending operations and no budget, and `stateright`'s
//! `LinearizabilityTester` (a good checker) brings a model checker and actor
//! runtime with it, and no bound on its search: a run must report "unknown"
//! rather than spin.

use std::collections::HashMap;

/// A sequential specification: what one operation does to the object's
/// state and what it answers.
pub trait Model {
    /// The object's state.
    type State: Clone + PartialEq;
    /// An operation's arguments.
    type Input;
    /// An operation's answer.
    type Output;

    /// The states `input` may leave when applied to `state` and answered
    /// `output` (`None`: a pending operation, any answer): empty when the
    /// specification never answers `output` there. More than one state when
    /// the specification leaves a choice (a store that may or may not have
    /// removed an expired record).
    fn step(
        &self,
        state: &Self::State,
        input: &Self::Input,
        output: Option<&Self::Output>,
    ) -> Vec<Self::State>;
}

/// One operation of a history.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation<I, O> {
    /// When it was called (the history's logical clock).
    pub call: u64,
    /// When it answered and what: `None` for a pending operation.
    pub answer: Option<(u64, O)>,
    /// Its arguments.
    pub input: I,
}

/// What the search found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A sequential order consistent with real time and the model exists.
    Linearizable,
    /// None does.
    NotLinearizable,
    /// The search ran out of its budget of steps before deciding.
    Unknown,
}

/// Whether `history`, starting from `initial`, is linearizable with respect
/// to `model`, exploring at most `budget` search steps.
pub fn check<M: Model>(
    model: &M,
    initial: M::State,
    history: &[Operation<M::Input, M::Output>],
    budget: u64,
) -> Verdict {
    let mut order: Vec<&Operation<M::Input, M::Output>> = history.iter().collect();
    order.sort_by_key(|op| op.call);
    let completed = order.iter().filter(|op| op.answer.is_some()).count();
    let mut search = Search {
        model,
        ops: order,
        done: vec![0; history.len().div_ceil(64)],
        seen: HashMap::new(),
        steps: 0,
        budget,
    };
    match search.from(initial, completed) {
        Ok(true) => Verdict::Linearizable,
        Ok(false) => Verdict::NotLinearizable,
        Err(OutOfBudget) => Verdict::Unknown,
    }
}

struct OutOfBudget;

struct Search<'a, M: Model> {
    model: &'a M,
    /// The operations, by call.
    ops: Vec<&'a Operation<M::Input, M::Output>>,
    /// The operations placed so far, as a bit set.
    done: Vec<u64>,
    /// Lowe's cache: the states already explored with each set placed.
    seen: HashMap<Vec<u64>, Vec<M::State>>,
    steps: u64,
    budget: u64,
}

impl<M: Model> Search<'_, M> {
    fn is_done(&self, i: usize) -> bool {
        self.done[i / 64] & (1 << (i % 64)) != 0
    }

    fn flip(&mut self, i: usize) {
        self.done[i / 64] ^= 1 << (i % 64);
    }

    /// Whether the operations not yet placed can follow `state`; `left` is
    /// how many of them have answered.
    fn from(&mut self, state: M::State, left: usize) -> Result<bool, OutOfBudget> {
        if left == 0 {
            return Ok(true);
        }
        self.steps += 1;
        if self.steps > self.budget {
            return Err(OutOfBudget);
        }
        let states = self.seen.entry(self.done.clone()).or_default();
        if states.contains(&state) {
            return Ok(false);
        }
        states.push(state.clone());
        // The next operation must have been called before every operation
        // not yet placed answered.
        let first_answer = (0..self.ops.len())
            .filter(|&i| !self.is_done(i))
            .filter_map(|i| self.ops[i].answer.as_ref().map(|(at, _)| *at))
            .min()
            .unwrap_or(u64::MAX);
        for i in 0..self.ops.len() {
            let op = self.ops[i];
            if op.call > first_answer {
                break;
            }
            if self.is_done(i) {
                continue;
            }
            let answered = usize::from(op.answer.is_some());
            let output = op.answer.as_ref().map(|(_, o)| o);
            for next in self.model.step(&state, &op.input, output) {
                self.flip(i);
                let found = self.from(next, left - answered);
                self.flip(i);
                if found? {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A register: writes answer nothing, reads answer the value.
    struct Register;

    #[derive(Debug, Clone, PartialEq)]
    enum Op {
        Write(u8),
        Read,
    }

    impl Model for Register {
        type State = u8;
        type Input = Op;
        type Output = Option<u8>;
        fn step(&self, state: &u8, input: &Op, output: Option<&Option<u8>>) -> Vec<u8> {
            match (input, output) {
                (Op::Write(v), None | Some(None)) => vec![*v],
                (Op::Read, None) => vec![*state],
                (Op::Read, Some(Some(v))) if v == state => vec![*state],
                _ => vec![],
            }
        }
    }

    fn op(call: u64, ret: Option<u64>, input: Op, output: Option<u8>) -> Operation<Op, Option<u8>> {
        Operation {
            call,
            answer: ret.map(|r| (r, output)),
            input,
        }
    }

    #[test]
    fn overlapping_operations_may_take_effect_in_either_order() {
        let h = [
            op(0, Some(3), Op::Write(1), None),
            op(1, Some(4), Op::Write(2), None),
            op(5, Some(6), Op::Read, Some(1)),
        ];
        assert_eq!(check(&Register, 0, &h, 1_000), Verdict::Linearizable);
    }

    #[test]
    fn a_read_of_a_value_before_its_write_was_called_is_not_linearizable() {
        let h = [
            op(0, Some(1), Op::Read, Some(1)),
            op(2, Some(3), Op::Write(1), None),
        ];
        assert_eq!(check(&Register, 0, &h, 1_000), Verdict::NotLinearizable);
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_not_linearizable() {
        let h = [
            op(0, Some(1), Op::Write(1), None),
            op(2, Some(3), Op::Write(2), None),
            op(4, Some(5), Op::Read, Some(1)),
        ];
        assert_eq!(check(&Register, 0, &h, 1_000), Verdict::NotLinearizable);
    }

    #[test]
    fn a_pending_operation_may_take_effect_late_or_never() {
        let pending = op(0, None, Op::Write(1), None);
        let late = [
            pending.clone(),
            op(1, Some(2), Op::Read, Some(0)),
            op(3, Some(4), Op::Read, Some(1)),
        ];
        assert_eq!(check(&Register, 0, &late, 1_000), Verdict::Linearizable);
        let never = [pending.clone(), op(1, Some(2), Op::Read, Some(0))];
        assert_eq!(check(&Register, 0, &never, 1_000), Verdict::Linearizable);
        let before_call = [
            op(0, Some(1), Op::Read, Some(1)),
            op(2, None, Op::Write(1), None),
        ];
        assert_eq!(
            check(&Register, 0, &before_call, 1_000),
            Verdict::NotLinearizable
        );
    }

    #[test]
    fn a_search_past_its_budget_is_unknown_not_a_pass() {
        // Many concurrent writes and a read no order explains: the search
        // must try every order.
        let mut h: Vec<_> = (0..12)
            .map(|i| {
                op(
                    i,
                    Some(100),
                    Op::Write(u8::try_from(i).unwrap_or(0) + 1),
                    None,
                )
            })
            .collect();
        h.push(op(101, Some(102), Op::Read, Some(99)));
        assert_eq!(check(&Register, 0, &h, 50), Verdict::Unknown);
        assert_eq!(
            check(&Register, 0, &h, 10_000_000),
            Verdict::NotLinearizable
        );
    }
}
