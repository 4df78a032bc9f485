#include "listening_ports.h"

#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace kvd::test_support {

std::set<uint16_t> ListeningTcpPorts(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  std::set<std::string> inodes;
  if (DIR* d = opendir((proc + "/fd").c_str())) {
    while (dirent* e = readdir(d)) {
      char link[256];
      const std::string path = proc + "/fd/" + e->d_name;
      ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
      if (n <= 0) continue;
      link[n] = '\0';
      if (std::strncmp(link, "socket:[", 8) == 0) {
        inodes.insert(std::string(link + 8, std::strlen(link) - 9));
      }
    }
    closedir(d);
  }
  std::set<uint16_t> ports;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::ifstream in(proc + table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
          inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      ports.insert(
          static_cast<uint16_t>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}

}  // namespace kvd::test_support
