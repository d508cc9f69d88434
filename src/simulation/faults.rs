//! The soak's fault matrix: which faults each round injects, and where, drawn from one seed so
//! that a failing run replays exactly.

/// A fault the soak injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Fault {
    /// A consumer's connection closed by the broker as a `kill -9` of its pod leaves it: no
    /// cancel, its unacknowledged deliveries requeued; the pod connects again, as a restarted
    /// container does.
    ConsumerKilled,
    /// The new pods hold each delivery a while before acknowledging it (a backlog of
    /// unacknowledged deliveries at every moment, through the rollout or the swap).
    SlowConsumers,
    /// The operator's gate killed and started afresh in the middle of a rollout.
    OperatorRestarted,
    /// The operator killed between two migration steps (the step's record fails, its
    /// connection goes), then resumed from the last record.
    MigrationStopped,
    /// The operator killed in the middle of a migration step, then resumed.
    MigrationCut,
    /// A broker node killed (`kill -9`) and started again; a cluster only.
    NodeKilled,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Every fault, in table order.
pub const ALL: [Fault; 6] = [
    Fault::ConsumerKilled,
    Fault::SlowConsumers,
    Fault::OperatorRestarted,
    Fault::MigrationStopped,
    Fault::MigrationCut,
    Fault::NodeKilled,
];

/// One round of the soak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Round {
    /// A guarded rolling restart of the consumer workload.
    Restart(Vec<Fault>),
    /// A live change of the queue's type, then the restart that follows it.
    Migration(Vec<Fault>),
}

/// `restarts` rolling restarts with `migrations` migrations spread evenly among them. Each round
/// has one fault of its kind in turn, so a short run has every kind, and the seed adds others
/// (each with odds of one in four). Node kills only where there is a cluster.
pub fn schedule(seed: u64, restarts: u32, migrations: u32, cluster: bool) -> Vec<Round> {
    let mut rng = Rng::new(seed);
    let restart_kinds: Vec<Fault> = [Fault::ConsumerKilled, Fault::SlowConsumers, Fault::OperatorRestarted]
        .into_iter()
        .chain(cluster.then_some(Fault::NodeKilled))
        .collect();
    let during_migration: Vec<Fault> =
        [Fault::SlowConsumers, Fault::ConsumerKilled].into_iter().chain(cluster.then_some(Fault::NodeKilled)).collect();
    let migration_kinds = [Fault::MigrationStopped, Fault::MigrationCut];
    let mut rounds = Vec::new();
    let every = restarts.checked_div(migrations).map_or(u32::MAX, |e| e.max(1));
    let (mut r, mut m) = (0u32, 0u32);
    while r < restarts || m < migrations {
        let migration_due = m < migrations && (r >= restarts || (r + 1) % every == 0 && r / every >= m);
        if migration_due {
            let mut faults =
                vec![migration_kinds[m as usize % 2], during_migration[m as usize % during_migration.len()]];
            faults.extend(during_migration.iter().copied().filter(|_| rng.below(4) == 0));
            rounds.push(Round::Migration(tidy(faults)));
            m += 1;
        } else {
            let mut faults = vec![restart_kinds[r as usize % restart_kinds.len()]];
            faults.extend(restart_kinds.iter().copied().filter(|_| rng.below(4) == 0));
            rounds.push(Round::Restart(tidy(faults)));
            r += 1;
        }
    }
    rounds
}

fn tidy(mut faults: Vec<Fault>) -> Vec<Fault> {
    faults.sort();
    faults.dedup();
    faults
}

/// A small deterministic generator (xorshift64*) for the schedule and each round's choices.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The generator of round `round` of a run seeded `seed`: a round replays alone.
    pub fn for_round(seed: u64, round: usize) -> Self {
        let mut rng = Self::new(seed ^ (round as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        rng.draw();
        rng
    }

    pub fn draw(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// In `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.draw() % n.max(1)
    }

    /// In `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(rounds: &[Round]) -> std::collections::BTreeSet<Fault> {
        rounds
            .iter()
            .flat_map(|r| match r {
                Round::Restart(f) | Round::Migration(f) => f.clone(),
            })
            .collect()
    }

    #[test]
    fn a_short_run_has_every_fault_and_the_rounds_asked_for() {
        let rounds = schedule(7, 6, 2, false);
        let restarts = rounds.iter().filter(|r| matches!(r, Round::Restart(_))).count();
        assert_eq!((restarts, rounds.len() - restarts), (6, 2));
        let every: std::collections::BTreeSet<Fault> = ALL.into_iter().filter(|f| *f != Fault::NodeKilled).collect();
        assert_eq!(kinds(&rounds), every);
        assert!(kinds(&schedule(7, 6, 2, true)).contains(&Fault::NodeKilled), "a cluster adds node kills");
        for round in &rounds {
            if let Round::Restart(f) = round {
                assert!(!f.contains(&Fault::MigrationCut) && !f.contains(&Fault::MigrationStopped));
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_run_and_migrations_spread_out() {
        assert_eq!(schedule(42, 100, 10, true), schedule(42, 100, 10, true));
        assert_ne!(schedule(42, 100, 10, true), schedule(43, 100, 10, true));
        let rounds = schedule(42, 100, 10, false);
        let at: Vec<usize> =
            rounds.iter().enumerate().filter(|(_, r)| matches!(r, Round::Migration(_))).map(|(i, _)| i).collect();
        assert_eq!(at.len(), 10);
        assert!(at.windows(2).all(|w| w[1] - w[0] >= 5), "spread out: {at:?}");
        assert_eq!(schedule(1, 0, 3, false).len(), 3, "migrations alone");
        assert_eq!(Rng::for_round(9, 3).draw(), Rng::for_round(9, 3).draw());
    }
}
