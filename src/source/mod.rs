//! Assignment sources: where the desired set comes from. Like kubelet's
//! sources, each produces the same thing, a full `AssignmentSet`, so the
//! executor does not care whether a control plane or manifest files spoke.
