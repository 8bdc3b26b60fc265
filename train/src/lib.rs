pub use tch;
