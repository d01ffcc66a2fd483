//! Test bed for rsb (filled in by the fixture work).
