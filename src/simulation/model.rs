//! The Deployment controller's RollingUpdate rules, reduced to what decides when consumers come
//! and go: new pods are created while the total stays within `replicas + maxSurge`, and old pods
//! are removed while the Ready pods stay at or above `replicas - maxUnavailable` (unready old
//! pods first, as the controller cleans up unhealthy replicas before scaling down healthy ones).

use crate::workload::strategy::Fenceposts;

/// What the model needs to know about one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodState {
    pub id: usize,
    pub revision: u32,
    pub ready: bool,
    pub terminating: bool,
}

/// One step of the controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Create { count: usize },
    Terminate { ids: Vec<usize> },
}

/// What the Deployment controller does next for `revision` given the pods (the arithmetic of
/// `reconcileNewReplicaSet` and `reconcileOldReplicaSets`).
pub fn next(pods: &[PodState], replicas: usize, revision: u32, fp: Fenceposts) -> Vec<Step> {
    let live: Vec<&PodState> = pods.iter().filter(|p| !p.terminating).collect();
    let new = live.iter().filter(|p| p.revision == revision).count();
    let new_ready = live.iter().filter(|p| p.revision == revision && p.ready).count();
    let mut steps = Vec::new();
    let max_total = replicas + fp.max_surge.max(0) as usize;
    let create = replicas.saturating_sub(new).min(max_total.saturating_sub(live.len()));
    if create > 0 {
        steps.push(Step::Create { count: create });
    }
    let all = (live.len() + create) as i64;
    let min_available = replicas.saturating_sub(fp.max_unavailable.max(0) as usize) as i64;
    let new_unavailable = (new + create - new_ready) as i64;
    let mut budget = all - min_available - new_unavailable;
    let mut ids = Vec::new();
    // Unhealthy old pods first: removing them costs no availability.
    let (unready, ready): (Vec<&&PodState>, Vec<&&PodState>) =
        live.iter().filter(|p| p.revision != revision).partition(|p| !p.ready);
    for p in unready {
        if budget <= 0 {
            break;
        }
        ids.push(p.id);
        budget -= 1;
    }
    let available = live.iter().filter(|p| p.ready).count() as i64;
    let healthy_down = (available - min_available).min(budget).max(0) as usize;
    ids.extend(ready.iter().take(healthy_down).map(|p| p.id));
    if !ids.is_empty() {
        steps.push(Step::Terminate { ids });
    }
    steps
}

/// The rollout of `revision` is done: `replicas` new pods, all Ready, and no old pods.
pub fn complete(pods: &[PodState], replicas: usize, revision: u32) -> bool {
    let live: Vec<&PodState> = pods.iter().filter(|p| !p.terminating).collect();
    live.len() == replicas && live.iter().all(|p| p.revision == revision && p.ready)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(surge: i32, unavailable: i32) -> Fenceposts {
        Fenceposts { max_surge: surge, max_unavailable: unavailable }
    }

    fn pods(spec: &[(u32, bool)]) -> Vec<PodState> {
        spec.iter()
            .enumerate()
            .map(|(id, &(revision, ready))| PodState { id, revision, ready, terminating: false })
            .collect()
    }

    #[test]
    fn surge_one_unavailable_zero_waits_for_each_new_pod_to_be_ready() {
        let start = pods(&[(1, true), (1, true)]);
        assert_eq!(next(&start, 2, 2, fp(1, 0)), [Step::Create { count: 1 }]);
        let booting = pods(&[(1, true), (1, true), (2, false)]);
        assert!(next(&booting, 2, 2, fp(1, 0)).is_empty(), "nothing happens until the new pod is Ready");
        let ready = pods(&[(1, true), (1, true), (2, true)]);
        assert_eq!(
            next(&ready, 2, 2, fp(1, 0)),
            [Step::Terminate { ids: vec![0] }],
            "at the surge ceiling an old pod goes first"
        );
        let replaced = pods(&[(1, true), (2, true)]);
        assert_eq!(next(&replaced, 2, 2, fp(1, 0)), [Step::Create { count: 1 }]);
    }

    #[test]
    fn max_unavailable_lets_old_pods_go_before_new_ones_are_ready() {
        let start = pods(&[(1, true)]);
        let steps = next(&start, 1, 2, fp(0, 1));
        assert_eq!(steps, [Step::Terminate { ids: vec![0] }], "with surge 0 the only old pod goes first");
        let start = pods(&[(1, true), (1, true), (1, true), (1, true)]);
        assert_eq!(next(&start, 4, 2, fp(1, 1)), [Step::Create { count: 1 }, Step::Terminate { ids: vec![0] }]);
    }

    #[test]
    fn unready_old_pods_go_first() {
        let p = pods(&[(1, true), (1, false), (2, true)]);
        assert_eq!(next(&p, 2, 2, fp(1, 0)), [Step::Terminate { ids: vec![1] }]);
    }

    #[test]
    fn completion_needs_all_new_pods_ready_and_no_old_ones() {
        assert!(complete(&pods(&[(2, true), (2, true)]), 2, 2));
        assert!(!complete(&pods(&[(2, true), (2, false)]), 2, 2));
        assert!(!complete(&pods(&[(2, true), (2, true), (1, true)]), 2, 2));
        let mut leaving = pods(&[(2, true), (2, true), (1, true)]);
        leaving[2].terminating = true;
        assert!(complete(&leaving, 2, 2), "terminating pods no longer count");
    }

    /// Driving the model to completion with instant readiness never drops below the floor.
    #[test]
    fn availability_never_drops_below_replicas_minus_max_unavailable() {
        for replicas in 1..=5usize {
            for (surge, unavailable) in [(1, 0), (0, 1), (2, 1), (1, 2)] {
                let f = fp(surge, unavailable);
                let mut state: Vec<PodState> =
                    (0..replicas).map(|id| PodState { id, revision: 1, ready: true, terminating: false }).collect();
                for _ in 0..100 {
                    if complete(&state, replicas, 2) {
                        break;
                    }
                    for step in next(&state, replicas, 2, f) {
                        match step {
                            Step::Create { count } => {
                                for _ in 0..count {
                                    let id = state.len();
                                    state.push(PodState { id, revision: 2, ready: false, terminating: false });
                                }
                            }
                            Step::Terminate { ids } => ids.iter().for_each(|&id| state[id].terminating = true),
                        }
                    }
                    let ready = state.iter().filter(|p| p.ready && !p.terminating).count();
                    assert!(ready + unavailable as usize >= replicas, "replicas {replicas} fp {f:?}: {ready} ready");
                    for p in state.iter_mut() {
                        p.ready = true; // becomes ready on the next tick
                    }
                }
                assert!(complete(&state, replicas, 2), "replicas {replicas} fp {f:?}");
            }
        }
    }
}
