//! The least the inspector's hooks can cost: an empty program on each of them.
//!
//! Every process on the node pays for an attached syscall tracepoint, watched
//! or not (see the crate's doc). How much of that is the kernel's mechanism and
//! how much the inspector's own work is what [`Floor`] separates: it attaches
//! `bpf/floor.bpf.c`'s programs, which return at once, to exactly the hooks the
//! inspector attaches on this kernel, read from the inspector's own object (so
//! the two cannot drift apart). The node benchmark (`scripts/bench-inspector-tax`,
//! through `examples/tracepoint_floor.rs`) runs its workloads with the floor
//! attached as one of its phases.

use std::mem::MaybeUninit;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, OpenObject, TracepointCategory};

use crate::skel::InspectorSkelBuilder;
use crate::tracefs::{Tracefs, TracefsError, tracepoint_of_section};

crate::bpf_skeleton!(skel, "floor.skel.rs");
use skel::{FloorSkel, FloorSkelBuilder};

#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[error("opening the {object} BPF object: {source}")]
    Open { object: &'static str, source: libbpf_rs::Error },
    #[error("loading the floor's BPF programs: {0}")]
    Load(#[source] libbpf_rs::Error),
    #[error("attaching an empty program to {hook}: {source}")]
    Attach { hook: String, source: libbpf_rs::Error },
    #[error("the inspector's program section {0:?} is neither a tracepoint nor a tp_btf hook the floor has")]
    UnknownHook(String),
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
}

/// A place the inspector attaches a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hook {
    /// `tp/<category>/<event>`: any tracepoint program can be attached there.
    Tracepoint { category: String, event: String },
    /// A `tp_btf/...` section: typed for its one hook, so the floor needs a
    /// program with the same section.
    Btf { section: String },
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hook::Tracepoint { category, event } => write!(f, "tracepoint {category}/{event}"),
            Hook::Btf { section } => write!(f, "{section}"),
        }
    }
}

/// Where programs of these ELF sections attach; an unknown kind of section is an error.
pub fn hooks_of_sections<'a>(sections: impl IntoIterator<Item = &'a str>) -> Result<Vec<Hook>, FloorError> {
    sections
        .into_iter()
        .map(|section| {
            if let Some((category, event)) = tracepoint_of_section(section) {
                Ok(Hook::Tracepoint { category: category.to_owned(), event: event.to_owned() })
            } else if section.starts_with("tp_btf/") {
                Ok(Hook::Btf { section: section.to_owned() })
            } else {
                Err(FloorError::UnknownHook(section.to_owned()))
            }
        })
        .collect()
}

/// The sections of the inspector's programs, all of them (what this kernel lacks included).
pub fn inspector_sections() -> Result<Vec<String>, FloorError> {
    sections_of(InspectorSkelBuilder::default(), "inspector")
}

/// The sections of the floor's own programs.
pub fn floor_sections() -> Result<Vec<String>, FloorError> {
    sections_of(FloorSkelBuilder::default(), "floor")
}

/// The program sections of a skeleton's object, read from the opened (not loaded) object.
fn sections_of<B>(builder: B, object: &'static str) -> Result<Vec<String>, FloorError>
where
    B: for<'obj> SkelBuilder<'obj>,
{
    let mut storage = MaybeUninit::uninit();
    let open = builder.open(&mut storage).map_err(|source| FloorError::Open { object, source })?;
    Ok(open.open_object().progs().map(|p| p.section().to_string_lossy().into_owned()).collect())
}

/// Empty programs attached to every hook the inspector attaches on this kernel
/// (a tracepoint this kernel lacks is skipped, as the inspector skips it).
/// Dropped: detached.
pub struct Floor<'obj> {
    links: Vec<Link>,
    _skel: FloorSkel<'obj>,
}

impl<'obj> Floor<'obj> {
    pub fn attach(storage: &'obj mut MaybeUninit<OpenObject>) -> Result<Self, FloorError> {
        let tracefs = Tracefs::ensure_mounted()?;
        let hooks: Vec<Hook> = hooks_of_sections(inspector_sections()?.iter().map(String::as_str))?
            .into_iter()
            .filter(|hook| match hook {
                Hook::Tracepoint { category, event } => tracefs.has_event(category, event),
                Hook::Btf { .. } => true,
            })
            .collect();
        let open =
            FloorSkelBuilder::default().open(storage).map_err(|source| FloorError::Open { object: "floor", source })?;
        let mut skel = open.load().map_err(FloorError::Load)?;
        let mut links = Vec::with_capacity(hooks.len());
        for hook in &hooks {
            let attached = match hook {
                Hook::Tracepoint { category, event } => {
                    let category = TracepointCategory::Custom(category.clone());
                    skel.progs.floor_syscall.attach_tracepoint(category, event.as_str())
                }
                Hook::Btf { section } => {
                    let prog = skel
                        .object_mut()
                        .progs_mut()
                        .find(|p| p.section().to_str() == Some(section.as_str()))
                        .ok_or_else(|| FloorError::UnknownHook(section.clone()))?;
                    prog.attach()
                }
            };
            links.push(attached.map_err(|source| FloorError::Attach { hook: hook.to_string(), source })?);
        }
        Ok(Floor { links, _skel: skel })
    }

    /// How many links are attached (one per hook).
    pub fn links(&self) -> usize {
        self.links.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_name_their_hooks_and_an_unknown_kind_is_refused() {
        let hooks = hooks_of_sections(["tp/syscalls/sys_enter_write", "tp_btf/sched_process_fork"]).unwrap();
        assert_eq!(
            hooks,
            [
                Hook::Tracepoint { category: "syscalls".into(), event: "sys_enter_write".into() },
                Hook::Btf { section: "tp_btf/sched_process_fork".into() },
            ]
        );
        let error = hooks_of_sections(["kprobe/vfs_write"]).unwrap_err();
        assert!(error.to_string().contains("\"kprobe/vfs_write\""), "{error}");
    }

    /// The floor can stand in for every hook of the inspector: each of its
    /// sections is a tracepoint (which the floor's one syscall program
    /// attaches to) or a tp_btf hook the floor has an empty program for. A new
    /// kind of hook in the inspector fails here, not in the benchmark.
    #[test]
    fn the_floor_has_a_program_for_every_hook_of_the_inspector() {
        let inspector = inspector_sections().unwrap();
        let floor = floor_sections().unwrap();
        let hooks = hooks_of_sections(inspector.iter().map(String::as_str)).unwrap();
        assert!(hooks.iter().filter(|h| matches!(h, Hook::Tracepoint { .. })).count() > 50, "{hooks:?}");
        for hook in &hooks {
            if let Hook::Btf { section } = hook {
                assert!(floor.contains(section), "the floor has no empty program for {section}: {floor:?}");
            }
        }
        assert!(floor.iter().any(|s| tracepoint_of_section(s).is_some()), "no tracepoint program in the floor");
    }
}
