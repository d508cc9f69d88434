//! The workload controllers' rollout rules, reduced to what decides when consumers come and go.
//!
//! [`next`]: the Deployment controller's RollingUpdate (and an Argo canary without steps or
//! traffic routing, which scales its ReplicaSets the same way): new pods are created while the
//! total stays within `replicas + maxSurge`, and old pods are removed while the Ready pods stay at
//! or above `replicas - maxUnavailable` (unready old pods first, as the controller cleans up
//! unhealthy replicas before scaling down healthy ones).
//!
//! [`next_ordered`]: the StatefulSet controller's RollingUpdate (OrderedReady, maxUnavailable
//! 1): no surge; the pod of the highest ordinal not yet updated is deleted once every pod is
//! Ready, and created again under its name (at the new revision) once the old one is gone.

use crate::workload::strategy::Fenceposts;

/// What the model needs to know about one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodState {
    pub id: usize,
    /// A StatefulSet pod's ordinal (its name); unused by the Deployment model.
    pub ordinal: usize,
    pub revision: u32,
    pub ready: bool,
    pub terminating: bool,
    /// Terminated and gone (its process stopped).
    pub gone: bool,
}

/// One step of the controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Create {
        count: usize,
    },
    /// A StatefulSet pod, created under its ordinal's name.
    CreateOrdinal {
        ordinal: usize,
    },
    Terminate {
        ids: Vec<usize>,
    },
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

/// What the StatefulSet controller does next for `revision`: nothing while a pod is going or not
/// Ready; else the lowest missing ordinal is created, or the highest one not at `revision` is
/// deleted.
pub fn next_ordered(pods: &[PodState], replicas: usize, revision: u32) -> Vec<Step> {
    if pods.iter().any(|p| p.terminating && !p.gone) {
        return vec![];
    }
    let live: Vec<&PodState> = pods.iter().filter(|p| !p.terminating).collect();
    if live.iter().any(|p| !p.ready) {
        return vec![];
    }
    if let Some(ordinal) = (0..replicas).find(|o| !live.iter().any(|p| p.ordinal == *o)) {
        return vec![Step::CreateOrdinal { ordinal }];
    }
    match live.iter().filter(|p| p.revision != revision).max_by_key(|p| p.ordinal) {
        Some(p) => vec![Step::Terminate { ids: vec![p.id] }],
        None => vec![],
    }
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
            .map(|(id, &(revision, ready))| PodState {
                id,
                ordinal: id,
                revision,
                ready,
                terminating: false,
                gone: false,
            })
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
                let mut state: Vec<PodState> = (0..replicas).map(|id| pod_at(id, id, 1, true)).collect();
                for _ in 0..100 {
                    if complete(&state, replicas, 2) {
                        break;
                    }
                    for step in next(&state, replicas, 2, f) {
                        match step {
                            Step::Create { count } => {
                                for _ in 0..count {
                                    let id = state.len();
                                    state.push(pod_at(id, id, 2, false));
                                }
                            }
                            Step::Terminate { ids } => ids.iter().for_each(|&id| state[id].terminating = true),
                            Step::CreateOrdinal { .. } => unreachable!("the Deployment model creates by count"),
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

    fn pod_at(id: usize, ordinal: usize, revision: u32, ready: bool) -> PodState {
        PodState { id, ordinal, revision, ready, terminating: false, gone: false }
    }

    #[test]
    fn a_statefulset_replaces_one_pod_at_a_time_from_the_highest_ordinal_without_surge() {
        let start = vec![pod_at(0, 0, 1, true), pod_at(1, 1, 1, true)];
        assert_eq!(next_ordered(&start, 2, 2), [Step::Terminate { ids: vec![1] }], "the highest ordinal first");
        let mut going = start.clone();
        going[1].terminating = true;
        assert!(next_ordered(&going, 2, 2).is_empty(), "its name is free only once it is gone");
        going[1].gone = true;
        assert_eq!(
            next_ordered(&going, 2, 2),
            [Step::CreateOrdinal { ordinal: 1 }],
            "no surge: one pod fewer until then"
        );
        going.push(pod_at(2, 1, 2, false));
        assert!(next_ordered(&going, 2, 2).is_empty(), "the next waits for the recreated pod to be Ready");
        going[2].ready = true;
        assert_eq!(next_ordered(&going, 2, 2), [Step::Terminate { ids: vec![0] }]);
        going[0].terminating = true;
        going[0].gone = true;
        going.push(pod_at(3, 0, 2, true));
        assert!(next_ordered(&going, 2, 2).is_empty());
        assert!(complete(&going, 2, 2));
    }

    /// Driven to completion, a StatefulSet never has fewer than `replicas - 1` pods Ready.
    #[test]
    fn a_statefulset_keeps_all_but_one_pod_ready() {
        for replicas in 1..=4usize {
            let mut state: Vec<PodState> = (0..replicas).map(|o| pod_at(o, o, 1, true)).collect();
            for _ in 0..100 {
                if complete(&state, replicas, 2) {
                    break;
                }
                for step in next_ordered(&state, replicas, 2) {
                    match step {
                        Step::CreateOrdinal { ordinal } => {
                            let id = state.len();
                            state.push(pod_at(id, ordinal, 2, false));
                        }
                        Step::Terminate { ids } => ids.iter().for_each(|&id| state[id].terminating = true),
                        Step::Create { .. } => unreachable!("the StatefulSet model creates by ordinal"),
                    }
                }
                let ready = state.iter().filter(|p| p.ready && !p.terminating).count();
                assert!(ready + 1 >= replicas, "replicas {replicas}: {ready} ready");
                for p in state.iter_mut() {
                    p.ready = true;
                    p.gone = p.terminating;
                }
            }
            assert!(complete(&state, replicas, 2), "replicas {replicas}");
        }
    }
}
