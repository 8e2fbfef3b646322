/// @file
/// Key-value stores used for rendezvous, like c10d's TCPStore and FileStore.
///
/// \code
///   // rank 0 (or the launcher) hosts the server; every process is a client.
///   auto server = std::make_unique<TcpStoreServer>("0.0.0.0", 29500);
///   TcpStore store("127.0.0.1", server->port(), std::chrono::seconds(30));
///   store.set("addr/0", bytes);
///   auto v = store.get("addr/1");           // blocks until set, or TimeoutError
///   int64_t n = store.add("arrived", 1);    // atomic counter
/// \endcode
/// A store on etcd, with the leases elastic membership needs, is in dtrain/comm/etcd.h.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::comm {

/// A value in a store: raw bytes.
using Bytes = std::vector<uint8_t>;
/// Timeouts of stores and groups.
using Duration = std::chrono::milliseconds;

/// The bytes of s, as they are.
Bytes toBytes(const std::string& s);
/// The bytes of b as a string, as they are.
std::string toString(const Bytes& b);

// Limits that bound what a store accepts from a peer; a request beyond them is rejected.
/// The longest key a store accepts, in bytes; a request beyond it is rejected.
inline constexpr size_t kMaxStoreKeyBytes = 4096;
/// The largest value a store accepts, in bytes; a request beyond it is rejected.
inline constexpr size_t kMaxStoreValueBytes = 64u << 20;

/// A key-value store that processes share for rendezvous: the interface of TcpStore, FileStore,
/// PrefixStore and EtcdStore.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets key to value, creating it or replacing its value.
  virtual void set(const std::string& key, const Bytes& value) = 0;
  /// Blocks until key exists (or timeout(): TimeoutError naming the key), then returns its value.
  virtual Bytes get(const std::string& key) = 0;
  /// Atomically adds delta to the integer stored at key (created as 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Sets key to desired if its current value equals expected (an empty expected matches a missing key).
  /// Returns the value after the operation.
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  /// Returns true if the key existed.
  virtual bool deleteKey(const std::string& key) = 0;
  /// True when every key exists, without waiting.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Blocks until every key exists; TimeoutError naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  /// wait(keys, timeout()).
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  /// The number of keys in the store.
  virtual int64_t numKeys() = 0;
  /// Another client of the same store with its own connection (a blocking get/wait on one client
  /// holds that client: threads that wait on keys each need their own). Same timeout.
  virtual std::shared_ptr<Store> clone() const = 0;

  /// How long get() and wait(keys) block before a TimeoutError.
  Duration timeout() const { return timeout_; }
  /// Sets timeout() for later operations.
  void setTimeout(Duration t) { timeout_ = t; }

 protected:
  /// For implementations: a store whose timeout() is `timeout`.
  explicit Store(Duration timeout) : timeout_(timeout) {}
  Duration timeout_;  ///< timeout()
};

/// The job secret given by the values of DTRAIN_SECRET and DTRAIN_SECRET_FILE (either may be null or
/// empty): the first, or the contents of the file the second names, which must be a regular file of
/// this user that nobody else may read or write (one trailing newline is dropped); "" when neither is
/// set. InvalidArgument naming the variable when both are set, or the file is missing, open to others
/// or empty. dtrain's own stores and transports take it from the environment (docs/SECURITY.md).
std::string jobSecretFrom(const char* secret, const char* secret_file);

/// Serves a TcpStore on host:port (port 0 picks a free one) from a background thread until destroyed.
/// Malformed or oversized requests close that client's connection; the server keeps serving others.
/// With a secret (jobSecretFrom) every client must prove it knows it before its first request
/// (challenge-response, HMAC-SHA256; the secret never crosses the wire); a client that does not is
/// refused, and the refusal is logged to stderr with its address.
class TcpStoreServer {
 public:
  /// Listens on host:port and starts serving; `secret`: the job secret clients must prove ("" for none).
  TcpStoreServer(const std::string& host, uint16_t port, std::string secret = "");
  /// Stops serving and joins the server's thread.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  /// The port it listens on (the one picked when 0 was given).
  uint16_t port() const;
  /// Clients connected now.
  int numClients() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// A client of a TcpStoreServer. Connecting retries until `timeout` (the server may start later).
/// Safe to use from several threads (requests are serialised). `secret` must be the server's:
/// RendezvousError "... authentication failed ..." otherwise (also when only one side has one).
class TcpStore : public Store {
 public:
  /// Connects to the server at host:port, retrying until `timeout`, which is also the store's timeout().
  TcpStore(const std::string& host, uint16_t port, Duration timeout, std::string secret = "");
  ~TcpStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  int64_t numKeys() override;
  std::shared_ptr<Store> clone() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// A store in one file on a filesystem every process sees (like c10d's FileStore and the file://
/// rendezvous of the MIL-NCE reference code on Slurm). Operations take an exclusive flock on the file.
class FileStore : public Store {
 public:
  /// The store in the file at `path`, created (or checked) now.
  FileStore(const std::string& path, Duration timeout);
  ~FileStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  int64_t numKeys() override;
  std::shared_ptr<Store> clone() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Prepends "prefix/" to every key: sub-groups and restarts share one underlying store.
class PrefixStore : public Store {
 public:
  /// The keys of base that start with "prefix/"; timeout() starts as base's. InvalidArgument for a null base.
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  /// The number of keys of the underlying store, under every prefix.
  int64_t numKeys() override;
  std::shared_ptr<Store> clone() const override;

 private:
  std::string k(const std::string& key) const { return prefix_ + "/" + key; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace dtrain::comm
