// EP groups: the default group size and the topology of one group.
#include <doctest/doctest.h>

#include "foremoe/plan/ep_groups.hpp"

using namespace foremoe;

TEST_CASE("default_ep_size: every GPU up to the experts, else the largest divisor not above them") {
  for (int gpus = 1; gpus <= 300; ++gpus)
    for (int experts = 1; experts <= 300; experts += 7) {
      const int ep = default_ep_size(gpus, experts);
      CAPTURE(gpus);
      CAPTURE(experts);
      CHECK(gpus % ep == 0);
      if (gpus <= experts) {
        CHECK(ep == gpus);
        continue;
      }
      CHECK(ep <= experts);
      for (int d = ep + 1; d <= experts; ++d)
        CHECK(gpus % d != 0);
    }
  CHECK(default_ep_size(1024, 256) == 256);
  CHECK_THROWS_AS((void)default_ep_size(0, 8), Error);
}

TEST_CASE("ep_group_topology: a group is whole nodes or part of one node, and every group has ep_size GPUs") {
  for (int nodes = 1; nodes <= 6; ++nodes)
    for (int gpn = 1; gpn <= 8; ++gpn)
      for (int ep = 1; ep <= nodes * gpn; ++ep) {
        CAPTURE(nodes);
        CAPTURE(gpn);
        CAPTURE(ep);
        const Topology topo{nodes, gpn, 3};
        if (topo.num_gpus() % ep != 0 || (ep % gpn != 0 && gpn % ep != 0)) {
          CHECK_THROWS_AS((void)ep_group_topology(topo, ep), Error);
          continue;
        }
        const Topology g = ep_group_topology(topo, ep);
        CHECK(g.num_gpus() == ep);
        CHECK(g.slots_per_gpu == topo.slots_per_gpu);
        CHECK((g.num_nodes == 1 || g.gpus_per_node == gpn)); // several nodes only when whole ones
      }
  CHECK_THROWS_AS((void)ep_group_topology(Topology{4, 4, 3}, 3), Error);
}
