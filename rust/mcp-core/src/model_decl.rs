//! The model a rank declares when it joins a job: the documents' Model-Spec, `arch`,
//! `precision` and `io_schema`, e.g.
//!
//! ```text
//! { "arch": "GPT-3", "precision": "bfloat16",
//!   "io_schema": { "input": ["token_ids:int32[bsz,seq]", "mask:bool[bsz,seq]"],
//!                  "output": ["logits:float16[bsz,seq,vocab]"] } }
//! ```
//!
//! Ranks that run different models (mixed deployments of an old and a new version) would
//! exchange frames whose shapes may even agree by chance; the rendezvous compares every
//! rank's declaration and refuses the job on every rank when two differ. The per-frame spec
//! ([`wire::ModelSpec`](crate::wire::ModelSpec): dtype, shape, op, codec) is checked on each
//! operation as before.
//!
//! A declaration is compared in its canonical form ([`ModelDecl::canonical`]): dtype aliases
//! (`bf16`, `fp16`, `half`, `fp32`, ...) are spelled as torch spells them, so that `"bf16"`
//! and `"bfloat16"` agree.

use std::fmt;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The longest `arch`, io group name, field name or named dimension, in bytes.
pub const MAX_NAME: usize = 128;
/// The most fields a declaration may list, over all its io groups.
pub const MAX_FIELDS: usize = 256;
/// The most dimensions of one field.
pub const MAX_FIELD_DIMS: usize = 16;
/// The longest canonical text a declaration may have, in bytes (it travels in the rendezvous
/// table).
pub const MAX_TEXT: usize = 16 * 1024;

/// A value of the declaration's table, as the caller's language gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeclValue {
    /// A string.
    Text(String),
    /// A list of strings (`io_schema` without groups: its fields are the `input`).
    List(Vec<String>),
    /// A table of string lists (`io_schema` with groups, e.g. `input` and `output`).
    Groups(Vec<(String, Vec<String>)>),
    /// Anything else: the name of its type, for the error.
    Other(String),
}

/// One dimension of a field: a name (`bsz`, `seq`) or a fixed size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dim {
    /// A symbolic size, the same symbol on every rank.
    Named(String),
    /// A fixed size.
    Size(u64),
}

/// One tensor of the io schema: `name:dtype[dim,dim,...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoField {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its dimensions (none: a scalar, written `name:dtype` or `name:dtype[]`).
    pub dims: Vec<Dim>,
}

/// The model a rank declares: architecture, precision and io schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDecl {
    /// The architecture's name, free text (`"GPT-3"`), compared exactly.
    pub arch: String,
    /// The training precision, a dtype.
    pub precision: DType,
    /// The io schema's groups in the order given (`input`, `output`, ...), each with its
    /// fields in order.
    pub io: Vec<(String, Vec<IoField>)>,
}

const KEYS: &str = "arch, precision, io_schema";

fn bad(what: String) -> Error {
    Error::InvalidArgument(format!("model_spec: {what}"))
}

/// A dtype by its torch name or a common alias.
fn dtype_of(name: &str) -> Option<DType> {
    let canonical = match name {
        "bf16" => "bfloat16",
        "fp16" | "half" | "f16" => "float16",
        "fp32" | "float" | "f32" => "float32",
        "fp64" | "double" | "f64" => "float64",
        "fp8" | "float8" | "fp8_e4m3" | "float8_e4m3" => "float8_e4m3fn",
        "fp8_e5m2" => "float8_e5m2",
        "int" => "int32",
        "long" => "int64",
        "short" => "int16",
        "cfloat" => "complex64",
        "cdouble" => "complex128",
        other => other,
    };
    DType::from_name(canonical).ok()
}

fn dtype_names() -> String {
    DType::ALL
        .iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

impl IoField {
    /// Parses `name:dtype[dim,...]` (spaces around the parts allowed).
    pub fn parse(text: &str) -> Result<IoField> {
        let form = || {
            bad(format!(
                "io field {text:?} is not `name:dtype[dim,...]` (e.g. \"token_ids:int32[bsz,seq]\"; a dimension is a name or a size)"
            ))
        };
        let (name, rest) = text.split_once(':').ok_or_else(form)?;
        let name = name.trim();
        if !is_ident(name) {
            return Err(form());
        }
        let rest = rest.trim();
        let (dtype, dims) = match rest.split_once('[') {
            None => (rest, ""),
            Some((d, tail)) => {
                let inner = tail.strip_suffix(']').ok_or_else(form)?;
                (d.trim(), inner)
            }
        };
        let dtype = dtype_of(dtype).ok_or_else(|| {
            bad(format!(
                "io field {text:?}: unknown dtype {dtype:?}; known: {}",
                dtype_names()
            ))
        })?;
        let mut out = Vec::new();
        if !dims.trim().is_empty() {
            for d in dims.split(',') {
                let d = d.trim();
                if let Ok(n) = d.parse::<u64>() {
                    out.push(Dim::Size(n));
                } else if is_ident(d) {
                    out.push(Dim::Named(d.to_string()));
                } else {
                    return Err(form());
                }
            }
        }
        if out.len() > MAX_FIELD_DIMS {
            return Err(bad(format!(
                "io field {text:?} has {} dimensions; at most {MAX_FIELD_DIMS}",
                out.len()
            )));
        }
        Ok(IoField {
            name: name.to_string(),
            dtype,
            dims: out,
        })
    }
}

impl fmt::Display for IoField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}[", self.name, self.dtype)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match d {
                Dim::Named(n) => f.write_str(n)?,
                Dim::Size(n) => write!(f, "{n}")?,
            }
        }
        f.write_str("]")
    }
}

fn fields(group: &str, list: &[String]) -> Result<Vec<IoField>> {
    let fields = list
        .iter()
        .map(|t| IoField::parse(t))
        .collect::<Result<Vec<_>>>()?;
    for (i, f) in fields.iter().enumerate() {
        if fields[..i].iter().any(|g| g.name == f.name) {
            return Err(bad(format!(
                "io_schema {group:?} names the field {:?} twice",
                f.name
            )));
        }
    }
    Ok(fields)
}

impl ModelDecl {
    /// Checks and builds a declaration from its table's `(key, value)` pairs: `arch` (text,
    /// required), `precision` (a dtype, required), `io_schema` (optional: a list of fields,
    /// or a table of lists such as `input` and `output`). An unknown key, a missing one or a
    /// bad value is an [`Error::InvalidArgument`] naming it.
    pub fn from_table(entries: Vec<(String, DeclValue)>) -> Result<ModelDecl> {
        let mut arch = None;
        let mut precision = None;
        let mut io = Vec::new();
        for (key, value) in entries {
            match (key.as_str(), value) {
                ("arch", DeclValue::Text(a)) => {
                    let a = a.trim().to_string();
                    if a.is_empty() || a.len() > MAX_NAME || a.chars().any(char::is_control) {
                        return Err(bad(format!(
                            "arch {a:?} must be 1 to {MAX_NAME} bytes of printable text"
                        )));
                    }
                    arch = Some(a);
                }
                ("precision", DeclValue::Text(p)) => {
                    precision = Some(dtype_of(p.trim()).ok_or_else(|| {
                        bad(format!(
                            "precision {p:?} is not a dtype; known: {} (and bf16, fp16, fp32)",
                            dtype_names()
                        ))
                    })?);
                }
                ("io_schema", DeclValue::List(list)) => {
                    io = vec![("input".to_string(), fields("input", &list)?)];
                }
                ("io_schema", DeclValue::Groups(groups)) => {
                    io.clear();
                    for (name, list) in groups {
                        if !is_ident(&name) {
                            return Err(bad(format!(
                                "io_schema group {name:?} must be a name such as \"input\" or \"output\""
                            )));
                        }
                        let f = fields(&name, &list)?;
                        io.push((name, f));
                    }
                }
                ("arch" | "precision", v) => {
                    return Err(bad(format!("{key} must be a string, got {}", kind(&v))))
                }
                ("io_schema", v) => {
                    return Err(bad(format!(
                        "io_schema must be a list of fields or a table of lists (e.g. {{\"input\": [...], \"output\": [...]}}), got {}",
                        kind(&v)
                    )))
                }
                _ => return Err(bad(format!("unknown key {key:?}; the keys are {KEYS}"))),
            }
        }
        let n: usize = io.iter().map(|(_, f)| f.len()).sum();
        if n > MAX_FIELDS {
            return Err(bad(format!(
                "io_schema lists {n} fields; at most {MAX_FIELDS}"
            )));
        }
        let decl = ModelDecl {
            arch: arch.ok_or_else(|| bad(format!("arch is missing; the keys are {KEYS}")))?,
            precision: precision
                .ok_or_else(|| bad(format!("precision is missing; the keys are {KEYS}")))?,
            io,
        };
        let len = decl.canonical().len();
        if len > MAX_TEXT {
            return Err(bad(format!(
                "the declaration takes {len} bytes; at most {MAX_TEXT} (shorter names, fewer fields)"
            )));
        }
        Ok(decl)
    }

    /// The canonical text two ranks compare: equal declarations, equal text.
    pub fn canonical(&self) -> String {
        self.to_string()
    }
}

fn kind(v: &DeclValue) -> String {
    match v {
        DeclValue::Text(_) => "a string".into(),
        DeclValue::List(_) => "a list".into(),
        DeclValue::Groups(_) => "a table".into(),
        DeclValue::Other(t) => t.clone(),
    }
}

impl fmt::Display for ModelDecl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "arch {:?}, precision {}", self.arch, self.precision)?;
        for (group, fields) in &self.io {
            write!(f, ", {group} [")?;
            for (i, x) in fields.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{x}")?;
            }
            f.write_str("]")?;
        }
        Ok(())
    }
}

/// Checks that every rank declared the same model (`decls[r]`: rank r's canonical text,
/// `None` when it declared none). A difference is an [`Error::SpecMismatch`] naming the first
/// rank that differs from rank 0 and both declarations; every rank reaches the same verdict
/// from the same table.
pub fn check_same(decls: &[Option<String>]) -> Result<()> {
    let Some(first) = decls.first() else {
        return Ok(());
    };
    let show = |d: &Option<String>| match d {
        Some(s) => format!("model_spec {{{s}}}"),
        None => "no model_spec".to_string(),
    };
    for (r, d) in decls.iter().enumerate().skip(1) {
        if d != first {
            return Err(Error::SpecMismatch(format!(
                "rank {r} declares {} but rank 0 declares {}: every rank of a job must run the same model (give each the same model_spec, or none to any)",
                show(d),
                show(first)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> DeclValue {
        DeclValue::Text(s.into())
    }

    fn list(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn documents() -> ModelDecl {
        ModelDecl::from_table(vec![
            ("arch".into(), text("GPT-3")),
            ("precision".into(), text("bfloat16")),
            (
                "io_schema".into(),
                DeclValue::Groups(vec![
                    (
                        "input".into(),
                        list(&["token_ids:int32[bsz,seq]", "mask:bool[bsz,seq]"]),
                    ),
                    ("output".into(), list(&["logits:float16[bsz,seq,vocab]"])),
                ]),
            ),
        ])
        .expect("the documents' example is a declaration")
    }

    #[test]
    fn the_documents_example_parses_to_its_canonical_text() {
        let d = documents();
        assert_eq!(d.precision, DType::BF16);
        assert_eq!(
            d.io[0].1[0].dims,
            vec![Dim::Named("bsz".into()), Dim::Named("seq".into())]
        );
        assert_eq!(
            d.canonical(),
            "arch \"GPT-3\", precision bfloat16, input [token_ids:int32[bsz,seq], mask:bool[bsz,seq]], output [logits:float16[bsz,seq,vocab]]"
        );
    }

    #[test]
    fn aliases_and_spacing_give_the_same_canonical_text() {
        let a = ModelDecl::from_table(vec![
            ("precision".into(), text(" bf16")),
            ("arch".into(), text("GPT-3 ")),
            (
                "io_schema".into(),
                DeclValue::Groups(vec![
                    (
                        "input".into(),
                        list(&["token_ids : int32[bsz, seq]", "mask:bool[bsz,seq]"]),
                    ),
                    ("output".into(), list(&["logits:fp16[bsz,seq,vocab]"])),
                ]),
            ),
        ])
        .expect("aliases are accepted");
        assert_eq!(a.canonical(), documents().canonical());
    }

    #[test]
    fn a_plain_list_is_the_input_and_sizes_and_scalars_parse() {
        let d = ModelDecl::from_table(vec![
            ("arch".into(), text("mlp")),
            ("precision".into(), text("fp32")),
            (
                "io_schema".into(),
                DeclValue::List(list(&["x:float32[64,784]", "step:int64"])),
            ),
        ])
        .expect("valid");
        assert_eq!(
            d.canonical(),
            "arch \"mlp\", precision float32, input [x:float32[64,784], step:int64[]]"
        );
    }

    #[test]
    fn bad_declarations_are_refused_naming_what_is_wrong() {
        let cases: Vec<(Vec<(String, DeclValue)>, &str)> = vec![
            (vec![("precision".into(), text("bf16"))], "arch is missing"),
            (vec![("arch".into(), text("x"))], "precision is missing"),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf17")),
                ],
                "precision \"bf17\"",
            ),
            (
                vec![("arch".into(), text("x")), ("colour".into(), text("red"))],
                "unknown key \"colour\"",
            ),
            (
                vec![("arch".into(), DeclValue::Other("int".into()))],
                "arch must be a string, got int",
            ),
            (vec![("arch".into(), text(""))], "arch \"\""),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    ("io_schema".into(), DeclValue::List(list(&["ids:int33[b]"]))),
                ],
                "unknown dtype \"int33\"",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    ("io_schema".into(), DeclValue::List(list(&["ids int32[b]"]))),
                ],
                "is not `name:dtype[dim,...]`",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    ("io_schema".into(), DeclValue::List(list(&["ids:int32[b"]))),
                ],
                "is not `name:dtype[dim,...]`",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    (
                        "io_schema".into(),
                        DeclValue::List(list(&["ids:int32[b-1]"])),
                    ),
                ],
                "is not `name:dtype[dim,...]`",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    (
                        "io_schema".into(),
                        DeclValue::List(list(&["a:int32", "a:int64"])),
                    ),
                ],
                "names the field \"a\" twice",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    ("io_schema".into(), text("ids:int32[b]")),
                ],
                "io_schema must be a list",
            ),
            (
                vec![
                    ("arch".into(), text("x")),
                    ("precision".into(), text("bf16")),
                    (
                        "io_schema".into(),
                        DeclValue::List(
                            (0..200)
                                .map(|i| format!("f{i}:int32[{0},{0}]", "d".repeat(100)))
                                .collect(),
                        ),
                    ),
                ],
                "at most 16384",
            ),
        ];
        for (entries, want) in cases {
            match ModelDecl::from_table(entries.clone()) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains(want), "{entries:?}: {m:?} lacks {want:?}")
                }
                other => panic!("{entries:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn check_same_names_the_first_rank_that_differs_and_both_declarations() {
        let a = Some(documents().canonical());
        let b = Some("arch \"GPT-2\", precision bfloat16".to_string());
        assert!(check_same(&[a.clone(), a.clone(), a.clone()]).is_ok());
        assert!(check_same(&[None, None]).is_ok());
        assert!(check_same(&[]).is_ok());
        match check_same(&[a.clone(), a.clone(), b.clone(), None]) {
            Err(Error::SpecMismatch(m)) => {
                assert!(
                    m.starts_with("rank 2 declares model_spec {arch \"GPT-2\""),
                    "{m}"
                );
                assert!(
                    m.contains("but rank 0 declares model_spec {arch \"GPT-3\""),
                    "{m}"
                );
            }
            other => panic!("{other:?}"),
        }
        match check_same(&[a, None]) {
            Err(Error::SpecMismatch(m)) => assert!(m.starts_with("rank 1 declares no model_spec")),
            other => panic!("{other:?}"),
        }
    }
}
