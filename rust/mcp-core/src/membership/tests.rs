//! The coordinator's state machine under a simulated clock, and the wire format.
#![allow(clippy::unwrap_used)]

use super::change::EpochChange;
use super::coordinator::{Beat, Coordinator, CoordinatorConfig, Master, Readiness};
use super::wire::{Reply, Request};
use super::{Epoch, Member, MemberId, NO_STATE};
use crate::error::Error;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

const SPEC: &str = "w:f32[4,3];b:f32[4]";

fn cfg(min: usize) -> CoordinatorConfig {
    CoordinatorConfig {
        min_members: min,
        dead_after: Duration::from_millis(500),
        join_window: Duration::from_millis(200),
        change_limit: Duration::from_secs(60),
        rebuild_window: Duration::from_millis(100),
    }
}

fn ms(t0: Instant, n: u64) -> Instant {
    t0 + Duration::from_millis(n)
}

fn formed(c: &Coordinator, id: MemberId, seen: u64) -> Epoch {
    match c.readiness(id, seen) {
        Readiness::Formed(e) => e.clone(),
        other => panic!("member {id} not in a new epoch past {seen}: {other:?}"),
    }
}

/// Starts a job of `ids` at t0 and returns the first epoch.
fn start(c: &mut Coordinator, t0: Instant, ids: &[MemberId]) -> Epoch {
    for (i, &id) in ids.iter().enumerate() {
        c.register(ms(t0, i as u64), id, SPEC, None).unwrap();
        c.report(ms(t0, i as u64), id, 0, NO_STATE);
    }
    let t = ms(t0, ids.len() as u64 + 250);
    for &id in ids {
        c.heartbeat(t, id, NO_STATE);
    }
    c.handle_timeout(t);
    formed(c, ids[0], 0)
}

#[test]
fn the_first_epoch_waits_for_the_join_window_then_has_everyone_in_arrival_order() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 7);
    c.register(t0, 10, SPEC, None).unwrap();
    c.report(t0, 10, 0, NO_STATE);
    c.register(ms(t0, 100), 20, SPEC, None).unwrap();
    c.report(ms(t0, 100), 20, 0, NO_STATE);
    c.handle_timeout(ms(t0, 150));
    assert_eq!(c.readiness(10, 0), Readiness::Waiting);
    let e = start(&mut c, ms(t0, 200), &[30]);
    assert_eq!(e.number, 1);
    assert_eq!(e.incarnation, 7);
    assert_eq!(
        e.members.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![10, 20, 30]
    );
    for id in [10, 20, 30] {
        assert_eq!(formed(&c, id, 0), e);
    }
    // Nobody has state: rank 0 is the source, everyone else takes its state.
    assert_eq!(e.heal_plan(), (0, vec![1, 2]));
    assert_eq!(e.step_after_heal(), 0);
}

#[test]
fn min_members_holds_the_first_epoch_back() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(3), 1);
    for (i, id) in [1, 2].into_iter().enumerate() {
        c.register(ms(t0, i as u64), id, SPEC, None).unwrap();
        c.report(ms(t0, i as u64), id, 0, NO_STATE);
    }
    for t in [300, 400] {
        for id in [1, 2] {
            c.heartbeat(ms(t0, t), id, NO_STATE);
        }
        c.handle_timeout(ms(t0, t));
    }
    assert!(c.current().is_none());
    c.register(ms(t0, 450), 3, SPEC, None).unwrap();
    c.report(ms(t0, 450), 3, 0, NO_STATE);
    for id in [1, 2, 3] {
        c.heartbeat(ms(t0, 700), id, NO_STATE);
    }
    c.handle_timeout(ms(t0, 700));
    assert_eq!(formed(&c, 1, 0).members.len(), 3);
}

#[test]
fn a_silent_member_is_dead_and_the_survivors_form_the_next_epoch_keeping_their_order() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2, 3, 4]);
    // Member 1 (rank 0) dies: the others heartbeat, it does not.
    let mut t = 300;
    while t < 900 {
        for id in [2, 3, 4] {
            let b = c.heartbeat(ms(t0, t), id, 5);
            assert!(b.member);
        }
        c.handle_timeout(ms(t0, t));
        t += 100;
    }
    let b = c.heartbeat(ms(t0, t), 2, 5);
    assert!(b.ends(e1.number), "survivors must be told to abort: {b:?}");
    assert!(b.ending);
    for id in [2, 3, 4] {
        c.report(ms(t0, t), id, e1.number, 5 + (id as i64 % 2));
    }
    let e2 = formed(&c, 3, 1);
    assert_eq!(e2.number, 2);
    assert_eq!(
        e2.members,
        vec![
            Member { id: 2, step: 5 },
            Member { id: 3, step: 6 },
            Member { id: 4, step: 5 }
        ]
    );
    // Rank 1 committed one step more (its all-reduce finished before the death): the others
    // take its state.
    assert_eq!(e2.heal_plan(), (1, vec![0, 2]));
    assert_eq!(e2.step_after_heal(), 6);
    let b = c.heartbeat(ms(t0, t + 10), 2, 6);
    assert!(!b.ends(2) && b.member && !b.ending);
}

#[test]
fn a_member_that_dies_during_the_change_is_left_out_and_the_rest_agree() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2, 3, 4]);
    // Member 4 reports that its all-reduce failed: the change begins.
    c.heartbeat(ms(t0, 400), 1, 3);
    c.heartbeat(ms(t0, 400), 2, 3);
    c.heartbeat(ms(t0, 400), 3, 3);
    c.report(ms(t0, 400), 4, e1.number, 3);
    c.report(ms(t0, 410), 1, e1.number, 3);
    // 2 reports, 3 dies before it can.
    c.report(ms(t0, 420), 2, e1.number, 3);
    assert_eq!(c.readiness(2, 1), Readiness::Waiting);
    for t in (500..=1000).step_by(50) {
        for id in [1, 2, 4] {
            c.heartbeat(ms(t0, t), id, 3);
        }
        c.handle_timeout(ms(t0, t));
    }
    let e2 = formed(&c, 1, 1);
    assert_eq!(
        e2.members.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![1, 2, 4]
    );
    for id in [2, 4] {
        assert_eq!(formed(&c, id, 1), e2);
    }
    assert_eq!(c.readiness(3, 1), Readiness::Unknown);
}

#[test]
fn a_newcomer_is_admitted_at_the_next_step_boundary_and_heals() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2]);
    for id in [1, 2] {
        let b = c.heartbeat(ms(t0, 300), id, 41);
        assert_eq!(b.change_at, None);
    }
    c.register(ms(t0, 310), 9, SPEC, None).unwrap();
    c.report(ms(t0, 310), 9, 0, NO_STATE);
    let b = c.heartbeat(ms(t0, 320), 1, 41);
    assert_eq!(b.change_at, Some(42));
    assert!(!b.ends(e1.number), "admission does not abort a step");
    // The members commit step 42 and report.
    c.report(ms(t0, 330), 1, e1.number, 42);
    let b = c.heartbeat(ms(t0, 331), 2, 42);
    assert!(
        b.ends(e1.number),
        "once one member left, the others' group is over"
    );
    c.report(ms(t0, 335), 2, e1.number, 42);
    let e2 = formed(&c, 9, 0);
    assert_eq!(
        e2.members,
        vec![
            Member { id: 1, step: 42 },
            Member { id: 2, step: 42 },
            Member {
                id: 9,
                step: NO_STATE
            }
        ]
    );
    assert_eq!(e2.heal_plan(), (0, vec![2]));
    assert_eq!(c.heartbeat(ms(t0, 340), 1, 42).change_at, None);
}

#[test]
fn a_frozen_member_is_expelled_and_comes_back_as_a_newcomer() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2, 3]);
    // 2 freezes at step 10; 1 and 3 go on.
    for t in (300..=900).step_by(100) {
        c.heartbeat(ms(t0, t), 1, 10);
        c.heartbeat(ms(t0, t), 3, 10);
        c.handle_timeout(ms(t0, t));
    }
    c.report(ms(t0, 900), 1, e1.number, 10);
    c.report(ms(t0, 900), 3, e1.number, 10);
    let e2 = formed(&c, 1, 1);
    assert_eq!(e2.members.len(), 2);
    // 2 wakes up: it is no member; its report makes it a newcomer without state, even
    // though it claims 11 steps (it may have committed a step the others never saw).
    let b = c.heartbeat(ms(t0, 1000), 2, 11);
    assert!(!b.member && b.ends(e1.number));
    c.report(ms(t0, 1000), 2, e1.number, 11);
    assert_eq!(c.heartbeat(ms(t0, 1001), 1, 10).change_at, Some(11));
    c.report(ms(t0, 1010), 1, e2.number, 11);
    c.report(ms(t0, 1010), 3, e2.number, 11);
    let e3 = formed(&c, 2, 1);
    assert_eq!(
        e3.members[2],
        Member {
            id: 2,
            step: NO_STATE
        }
    );
    assert_eq!(e3.heal_plan(), (0, vec![2]));
}

#[test]
fn a_member_that_leaves_lets_the_others_finish_its_last_step_then_goes() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2]);
    c.leave(ms(t0, 300), 2);
    // Not aborted: 1 completes the step 2 took part in before it left.
    assert!(!c.heartbeat(ms(t0, 301), 1, 4).ends(e1.number));
    // 1's next collective fails (2 is gone): it reports, and goes on alone.
    c.report(ms(t0, 302), 1, e1.number, 4);
    assert_eq!(formed(&c, 1, 1).members, vec![Member { id: 1, step: 4 }]);
}

#[test]
fn a_process_that_exits_is_dead_at_once_and_one_that_left_is_not_killed_again() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2, 3]);
    c.died(ms(t0, 300), 3);
    let b = c.heartbeat(ms(t0, 301), 1, 9);
    assert!(
        b.ending && b.ends(e1.number),
        "no heartbeat silence needed: {b:?}"
    );
    c.report(ms(t0, 302), 1, e1.number, 9);
    c.report(ms(t0, 302), 2, e1.number, 9);
    let e2 = formed(&c, 1, 1);
    assert_eq!(e2.members.len(), 2);
    // 2 leaves (its tether closes after): the epoch is not ended by the closing tether.
    c.leave(ms(t0, 400), 2);
    c.died(ms(t0, 401), 2);
    assert!(!c.heartbeat(ms(t0, 402), 1, 10).ending);
}

#[test]
fn a_different_model_is_refused_at_admission_naming_both() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    c.register(t0, 1, SPEC, None).unwrap();
    let err = c.register(t0, 2, "w:f32[4,3];b:f16[4]", None).unwrap_err();
    match err {
        Error::SpecMismatch(m) => {
            assert!(m.contains("'b:f32[4]'") && m.contains("'b:f16[4]'"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    let err = c.register(t0, 3, "w:f32[4,3]", None).unwrap_err();
    assert!(err.to_string().contains("nothing more"), "{err}");
}

#[test]
fn a_restarted_coordinator_rebuilds_the_epoch_from_its_members() {
    let t0 = Instant::now();
    let mut old = Coordinator::new(cfg(1), 1);
    let e = start(&mut old, t0, &[1, 2, 3]);
    drop(old);
    let mut c = Coordinator::new(cfg(1), 2);
    for id in [1, 2, 3] {
        c.register(ms(t0, 1000), id, SPEC, Some(e.clone())).unwrap();
    }
    assert_eq!(c.current(), Some(&e));
    let b = c.heartbeat(ms(t0, 1001), 2, 7);
    assert!(b.member && !b.ends(e.number), "training goes on: {b:?}");
    // Then 3 dies: the next epoch continues the numbering, under the new incarnation.
    for t in (1100..=1600).step_by(100) {
        c.heartbeat(ms(t0, t), 1, 7);
        c.heartbeat(ms(t0, t), 2, 7);
        c.handle_timeout(ms(t0, t));
    }
    c.report(ms(t0, 1600), 1, e.number, 7);
    c.report(ms(t0, 1600), 2, e.number, 7);
    let e2 = formed(&c, 1, e.number);
    assert_eq!(e2.number, e.number + 1);
    assert_eq!(e2.incarnation, 2);
    assert_ne!(e2.group_secret(b"s"), e.group_secret(b"s"));
}

#[test]
fn a_restarted_coordinator_waits_for_the_running_epoch_before_forming_its_own() {
    let t0 = Instant::now();
    let mut old = Coordinator::new(cfg(1), 1);
    let e = start(&mut old, t0, &[1, 2]);
    let mut c = Coordinator::new(
        CoordinatorConfig {
            rebuild_window: Duration::from_secs(1),
            ..cfg(1)
        },
        2,
    );
    // A newcomer reaches the restarted coordinator before the running members do.
    c.register(ms(t0, 1000), 9, SPEC, None).unwrap();
    c.report(ms(t0, 1000), 9, 0, NO_STATE);
    c.handle_timeout(ms(t0, 1300));
    assert!(
        c.current().is_none(),
        "no second group beside the running one"
    );
    for id in [1, 2] {
        c.register(ms(t0, 1400), id, SPEC, Some(e.clone())).unwrap();
    }
    assert_eq!(c.current(), Some(&e));
    // The newcomer is admitted the usual way, at the members' next step boundary.
    c.report(ms(t0, 1410), 9, 0, NO_STATE);
    // The steps it knows are the view's: any member past them reports at its next boundary.
    assert!(c
        .heartbeat(ms(t0, 1420), 1, 30)
        .change_at
        .is_some_and(|s| s <= 31));
    c.report(ms(t0, 1430), 1, e.number, 31);
    c.report(ms(t0, 1430), 2, e.number, 31);
    let e2 = formed(&c, 9, 0);
    assert_eq!(e2.members.len(), 3);
    assert!(e2.number > e.number);
}

#[test]
fn masters_are_published_by_rank_zero_only_and_superseded_epochs_say_so() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(cfg(1), 1);
    let e1 = start(&mut c, t0, &[1, 2]);
    assert_eq!(c.master(e1.number), Master::Pending);
    assert!(!c.publish_master(2, e1.number, "127.0.0.1:9".into()));
    assert!(c.publish_master(1, e1.number, "127.0.0.1:5".into()));
    assert_eq!(c.master(e1.number), Master::At("127.0.0.1:5".into()));
    c.report(ms(t0, 300), 1, e1.number, 0);
    c.report(ms(t0, 300), 2, e1.number, 0);
    assert_eq!(c.master(e1.number), Master::Superseded);
    assert_eq!(c.master(e1.number + 1), Master::Pending);
}

/// Random deaths, freezes, arrivals and reports over many epochs: every formed epoch has
/// increasing number, distinct live members, at least `min_members`, and keeps the order of
/// the members it carries over; a heal plan's source always has the most steps.
#[test]
fn random_failures_keep_the_epochs_consistent() {
    for seed in 0..20u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let t0 = Instant::now();
        let mut c = Coordinator::new(cfg(2), seed);
        let mut alive: Vec<(MemberId, u64, i64)> = Vec::new(); // (id, epoch it runs in, step)
        let mut next_id = 1;
        let mut last: Option<Epoch> = None;
        let mut t = 0;
        for _ in 0..3000 {
            t += rng.random_range(1..60);
            let now = ms(t0, t);
            match rng.random_range(0..100) {
                0..=2 if alive.len() > 1 => {
                    let i = rng.random_range(0..alive.len());
                    alive.swap_remove(i); // killed: goes silent
                }
                3..=5 if alive.len() < 8 => {
                    c.register(now, next_id, SPEC, None).unwrap();
                    c.report(now, next_id, 0, NO_STATE);
                    alive.push((next_id, 0, NO_STATE));
                    next_id += 1;
                }
                _ => {}
            }
            for (id, epoch, step) in alive.iter_mut() {
                let b: Beat = c.heartbeat(now, *id, *step);
                let running = *epoch > 0 && *epoch == b.latest && b.member;
                if *epoch > 0 && b.ends(*epoch) {
                    c.report(now, *id, *epoch, if b.member { *step } else { NO_STATE });
                    *epoch = 0;
                } else if running && b.change_at.is_some_and(|s| *step >= s) {
                    c.report(now, *id, *epoch, *step);
                    *epoch = 0;
                } else if running && rng.random_range(0..4) == 0 {
                    *step += 1;
                }
            }
            c.handle_timeout(now);
            if let Some(e) = c.current().cloned() {
                if last.as_ref().is_none_or(|l| l.number != e.number) {
                    let mut ids: Vec<_> = e.members.iter().map(|m| m.id).collect();
                    assert!(e.members.len() >= 2, "seed {seed}: {e:?}");
                    if let Some(l) = &last {
                        assert!(e.number > l.number);
                        let carried: Vec<_> = l
                            .members
                            .iter()
                            .map(|m| m.id)
                            .filter(|id| ids.contains(id))
                            .collect();
                        assert_eq!(&ids[..carried.len()], &carried[..], "seed {seed}");
                    }
                    ids.sort_unstable();
                    ids.dedup();
                    assert_eq!(ids.len(), e.members.len(), "seed {seed}: {e:?}");
                    let (src, takers) = e.heal_plan();
                    let best = e.members.iter().map(|m| m.step).max().unwrap_or(NO_STATE);
                    assert!(e.members[src].step == best || best == NO_STATE);
                    assert!(!takers.contains(&src));
                    last = Some(e.clone());
                }
                for (id, epoch, step) in alive.iter_mut() {
                    if *epoch == 0 {
                        if let Readiness::Formed(f) = c.readiness(*id, 0) {
                            if f.number == e.number {
                                *epoch = f.number;
                                *step = f.step_after_heal();
                            }
                        }
                    }
                }
            }
        }
        assert!(
            last.is_some_and(|l| l.number > 1),
            "seed {seed}: no epochs changed"
        );
    }
}

#[test]
fn messages_round_trip_and_damaged_ones_are_refused() {
    let e = Epoch {
        number: 3,
        incarnation: 9,
        members: vec![
            Member { id: 1, step: 5 },
            Member {
                id: 2,
                step: NO_STATE,
            },
        ],
    };
    let reqs = [
        Request::Register {
            id: 1,
            spec: SPEC.into(),
            view: Some(e.clone()),
        },
        Request::Register {
            id: 1,
            spec: String::new(),
            view: None,
        },
        Request::Heartbeat { id: 4, step: -1 },
        Request::Report {
            id: 4,
            seen: 2,
            step: 8,
            wait_ms: 100,
            holds: None,
        },
        Request::Report {
            id: 4,
            seen: 2,
            step: 8,
            wait_ms: 100,
            holds: Some((2, 0xfeed)),
        },
        Request::PublishMaster {
            id: 1,
            epoch: 3,
            addr: "10.0.0.1:5000".into(),
        },
        Request::Master {
            epoch: 3,
            wait_ms: 5,
        },
        Request::Leave { id: 7 },
        Request::Watch {
            id: 7,
            epoch: 3,
            wait_ms: 2000,
        },
    ];
    for r in &reqs {
        let b = r.encode();
        assert_eq!(&Request::decode(&b).unwrap(), r);
        for cut in [0, 5, b.len() - 1] {
            assert!(Request::decode(&b[..cut]).is_err());
        }
        let mut bad = b.clone();
        bad[9] ^= 1;
        assert!(matches!(Request::decode(&bad), Err(Error::Protocol(_))));
    }
    let replies = [
        Reply::Ok,
        Reply::Refused("no".into()),
        Reply::Beat(Beat {
            latest: 4,
            ending: true,
            change_at: Some(0),
            member: false,
        }),
        Reply::Beat(Beat {
            latest: 0,
            ending: false,
            change_at: None,
            member: true,
        }),
        Reply::Formed(e),
        Reply::Changed(EpochChange {
            base: 2,
            number: 5,
            incarnation: 9,
            left: vec![0, 3],
            came: vec![77, 78],
            steps: vec![(4, 2), (NO_STATE, 2)],
        }),
        Reply::Changed(EpochChange {
            base: 2,
            number: 3,
            incarnation: 9,
            left: vec![],
            came: vec![],
            steps: vec![],
        }),
        Reply::Waiting,
        Reply::Unknown,
        Reply::MasterAt("h:1".into()),
        Reply::Superseded,
        Reply::Welcome {
            token: [7; 16],
            tether: true,
        },
    ];
    for r in &replies {
        assert_eq!(&Reply::decode(&r.encode()).unwrap(), r);
    }
    // A member count larger than the bytes that follow is refused before allocating.
    let mut huge = Reply::Formed(Epoch {
        number: 1,
        incarnation: 1,
        members: vec![],
    })
    .encode();
    let body_len = huge.len() - 12;
    huge[8 + 17..8 + 21].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = crc32c::crc32c(&huge[8..8 + body_len]);
    let n = huge.len();
    huge[n - 4..].copy_from_slice(&crc.to_le_bytes());
    assert!(Reply::decode(&huge).is_err());
    // Likewise a change's counts.
    let change = Reply::Changed(EpochChange {
        base: 1,
        number: 2,
        incarnation: 1,
        left: vec![],
        came: vec![],
        steps: vec![],
    })
    .encode();
    for at in [8 + 25, 8 + 29, 8 + 33] {
        let mut huge = change.clone();
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let n = huge.len();
        let crc = crc32c::crc32c(&huge[8..n - 4]);
        huge[n - 4..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(Reply::decode(&huge), Err(Error::Protocol(_))));
    }
}
