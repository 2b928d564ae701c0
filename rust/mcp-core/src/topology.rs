//! Which ranks share a host: the input of the hierarchical collectives.
//!
//! A [`Topology`] gives every rank its host index (hosts numbered `0..H` by the first rank
//! that names them) and derives what the algorithms need: the ranks of each host in rank
//! order, each rank's local rank, and the counterparts (the ranks with one local rank on
//! every host) that carry the inter-host part of an operation. It is a value: discovery
//! (at the rendezvous, or `MCP_HOST_ID` per rank) fills it, and a group takes it as given.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;

/// The host of every rank, and the views derived from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    host_of: Vec<usize>,
    local: Vec<usize>,
    ranks: Vec<Vec<usize>>,
}

impl Topology {
    /// From each rank's host label (anything that names a host: `MCP_HOST_ID`, a machine
    /// id). Ranks with equal labels share a host; hosts are numbered by first appearance.
    pub fn from_host_ids<S: AsRef<str>>(ids: &[S]) -> Result<Topology> {
        let mut index: HashMap<&str, usize> = HashMap::new();
        let host_of = ids
            .iter()
            .map(|id| {
                let n = index.len();
                *index.entry(id.as_ref()).or_insert(n)
            })
            .collect();
        Topology::from_host_of_rank(host_of)
    }

    /// From each rank's host number. Numbers only name hosts: they are renumbered by first
    /// appearance, so `[5, 5, 2]` is the same topology as `[0, 0, 1]`.
    pub fn from_host_of_rank(host_of: Vec<usize>) -> Result<Topology> {
        if host_of.is_empty() {
            return Err(Error::InvalidArgument(
                "a topology needs at least one rank".into(),
            ));
        }
        let mut renumber: HashMap<usize, usize> = HashMap::new();
        let mut ranks: Vec<Vec<usize>> = Vec::new();
        let mut local = Vec::with_capacity(host_of.len());
        let mut hosts = Vec::with_capacity(host_of.len());
        for (rank, label) in host_of.into_iter().enumerate() {
            let h = *renumber.entry(label).or_insert_with(|| {
                ranks.push(Vec::new());
                ranks.len() - 1
            });
            local.push(ranks[h].len());
            ranks[h].push(rank);
            hosts.push(h);
        }
        Ok(Topology {
            host_of: hosts,
            local,
            ranks,
        })
    }

    /// Every rank on one host (what a group assumes until told otherwise).
    pub fn single_host(world: usize) -> Topology {
        Topology {
            host_of: vec![0; world],
            local: (0..world).collect(),
            ranks: vec![(0..world).collect()],
        }
    }

    /// Fails unless this topology describes exactly `world` ranks.
    pub fn check_world(&self, world: usize) -> Result<()> {
        if self.world() != world {
            return Err(Error::InvalidArgument(format!(
                "the topology covers {} ranks but the group has {world}; give one host per rank (ranks 0..{world})",
                self.world()
            )));
        }
        Ok(())
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.host_of.len()
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.ranks.len()
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The position of `rank` among the ranks of its host.
    pub fn local_rank(&self, rank: usize) -> usize {
        self.local[rank]
    }

    /// The ranks on `host`, in rank order.
    pub fn ranks_of(&self, host: usize) -> &[usize] {
        &self.ranks[host]
    }

    /// The host index of every rank.
    pub fn host_of_rank(&self) -> &[usize] {
        &self.host_of
    }

    /// The fewest ranks any host has: the number of shards the hierarchical collectives
    /// cut a buffer into, so that every host has an owner for every shard.
    pub fn min_local(&self) -> usize {
        self.ranks.iter().map(Vec::len).min().unwrap_or(0)
    }

    /// The ranks with local rank `local` on each host, in host order: the members of one
    /// inter-host sub-group (`local < min_local()`).
    pub fn counterparts(&self, local: usize) -> Vec<usize> {
        self.ranks
            .iter()
            .filter_map(|rs| rs.get(local).copied())
            .collect()
    }

    /// The leader of every host (its first rank), except that `root`'s host is led by
    /// `root`: the members of a hierarchical broadcast's inter-host part.
    pub fn leaders(&self, root: usize) -> Vec<usize> {
        let rh = self.host_of(root);
        (0..self.hosts())
            .map(|h| if h == rh { root } else { self.ranks[h][0] })
            .collect()
    }

    /// The local ranks (positions on `host`) that shard `i` of `min_local()` groups holds:
    /// a host with more ranks than the smallest one splits them into that many contiguous
    /// groups, the first ones one larger.
    pub fn group(&self, host: usize, i: usize) -> Range<usize> {
        let (l, m) = (self.ranks[host].len(), self.min_local());
        let (base, extra) = (l / m, l % m);
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }

    /// True when a hierarchical algorithm differs from a flat one: more than one host, and
    /// more than one rank on some host.
    pub fn is_hierarchical(&self) -> bool {
        self.hosts() > 1 && self.hosts() < self.world()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_numbered_by_first_appearance() {
        let t = Topology::from_host_ids(&["b", "a", "b", "c", "a"]).expect("valid");
        assert_eq!(t.host_of_rank(), &[0, 1, 0, 2, 1]);
        assert_eq!(t.ranks_of(0), &[0, 2]);
        assert_eq!(t.ranks_of(1), &[1, 4]);
        assert_eq!(t.ranks_of(2), &[3]);
        assert_eq!(t.local_rank(4), 1);
        assert_eq!(t.min_local(), 1);
        assert_eq!(t.counterparts(0), vec![0, 1, 3]);
        assert_eq!(t.counterparts(1), vec![2, 4]);
        assert_eq!(t.leaders(4), vec![0, 4, 3]);
        assert!(t.is_hierarchical());
        assert_eq!(
            Topology::from_host_of_rank(vec![5, 5, 2]).expect("valid"),
            Topology::from_host_of_rank(vec![0, 0, 1]).expect("valid")
        );
    }

    #[test]
    fn groups_split_a_larger_host_among_the_shards() {
        let t = Topology::from_host_of_rank(vec![0, 0, 1, 1, 1, 1, 1]).expect("valid");
        assert_eq!(t.min_local(), 2);
        assert_eq!(t.group(0, 0), 0..1);
        assert_eq!(t.group(0, 1), 1..2);
        assert_eq!(t.group(1, 0), 0..3);
        assert_eq!(t.group(1, 1), 3..5);
    }

    #[test]
    fn flat_shapes_are_not_hierarchical() {
        assert!(!Topology::single_host(4).is_hierarchical());
        let one_each = Topology::from_host_of_rank(vec![0, 1, 2]).expect("valid");
        assert!(!one_each.is_hierarchical());
    }

    #[test]
    fn bad_topologies_are_refused() {
        assert!(matches!(
            Topology::from_host_of_rank(Vec::new()),
            Err(Error::InvalidArgument(_))
        ));
        let t = Topology::from_host_of_rank(vec![0, 0, 1]).expect("valid");
        let e = t.check_world(4).expect_err("3 ranks do not cover 4");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("covers 3 ranks")));
    }
}
